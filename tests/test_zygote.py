"""Instances forked from their model's zygote (``start_method: fork``, the default for a CPU model): output
equal to spawned instances', a first request right after the fork, a crashed instance replaced by a fork, a
zygote killed under load (its instances keep serving, its spare takes its place: no model loaded again), no
zombies and no orphans, and the zygote stopped with its model's last instance."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from helpers import children, ppid, running, wait_for

from mpserve import Client
from mpserve.wire.slots import SlotState

PROMPTS = ["Once upon a time", "The capital of France is", "1, 2, 3,"]
FORKED = "instances start from a zygote"
LOADED = "instances are forked from here"


def descendants(pid: int) -> list[int]:
    found = []
    for child in children(pid):
        found += [child, *descendants(child)]
    return found


def zombies(pids: list[int]) -> list[int]:
    """Those of ``pids`` that have a child that exited and was not reaped."""
    return [child for pid in pids if running(pid) for child in children(pid) if not running(child)]


def worker_pids(server: Any) -> set[int]:
    return {r.pid for r in server.slots() if r.state in (SlotState.IDLE, SlotState.BUSY) and running(r.pid)}


def scalable(start_server: Any, tmp_path: Path, low: int, high: int) -> tuple[Any, int]:
    """A server of the tiny model with ``low``..``high`` instances, ready; and its zygote's pid."""
    config = tmp_path / "c.yaml"
    config.write_text(f"models:\n  - path: builtin:tiny\n    name: tiny\n    instances: {{min: {low}, max: {high}}}\n")
    server = start_server("--config", str(config)).wait_ready()
    return server, ppid(min(worker_pids(server)))


def greedy(server: Any, max_tokens: int = 24) -> list[str]:
    with Client(server.address) as client:
        return [client.generate(p, max_tokens=max_tokens, temperature=0, timeout=60).text for p in PROMPTS]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("threads", [1, 4])
def test_forked_instances_answer_right_after_the_fork_as_spawned_ones_do(start_server, threads: int) -> None:
    """The child's first decode is its warm-up, after the fork (llama.cpp's threads start in the child); its
    first request gets what a spawned instance gives, at 1 and at 4 threads."""
    outputs = {}
    for method in ("fork", "spawn"):
        server = start_server("--instances", "1", "--threads", str(threads), "--start-method", method).wait_ready()
        outputs[method] = greedy(server)
        assert any(FORKED in line for line in server.log) is (method == "fork"), "\n".join(server.log)
        assert not server.tracebacks(), "\n".join(server.log)
        server.stop()
    assert outputs["fork"] == outputs["spawn"]


@pytest.mark.timeout(120)
def test_a_crashed_instance_is_replaced_by_a_fork_of_the_same_zygote(start_server) -> None:
    server = start_server("--instances", "2").wait_ready()
    pids = worker_pids(server)
    zygote = {ppid(pid) for pid in pids}
    assert len(pids) == 2 and len(zygote) == 1 and zygote != {server.proc.pid}
    zygote_pid = zygote.pop()
    assert ppid(zygote_pid) in children(server.proc.pid)  # the zygote came from the server's fork server
    victim = min(pids)
    os.kill(victim, signal.SIGKILL)
    new = wait_for(lambda: (w := worker_pids(server)) - pids and len(w) == 2 and w, 30, "a replacement")
    assert victim not in new and all(ppid(pid) == zygote_pid for pid in new)
    assert greedy(server, 4)
    assert sum(LOADED in line for line in server.log) == 1  # the model was loaded once
    assert not zombies([server.proc.pid, zygote_pid])
    assert not server.tracebacks(), "\n".join(server.log)


def gguf_mappings(pid: int) -> set[tuple[str, str]]:
    """The address ranges at which process ``pid`` maps GGUF files, with each file's path."""
    rows = (line.split() for line in Path(f"/proc/{pid}/maps").read_text().splitlines())
    return {(row[0], row[5]) for row in rows if len(row) > 5 and row[5].endswith(".gguf")}


@pytest.mark.timeout(120)
def test_forked_instances_map_the_zygote_s_weights_and_load_none_of_their_own(start_server) -> None:
    """llama.cpp maps the model file when it loads it: each instance has exactly the zygote's mappings of it,
    inherited at the fork, and no mapping of its own (an instance that loaded the model again would map the file
    a second time, at another address)."""
    server = start_server("--instances", "2").wait_ready()
    pids = worker_pids(server)
    zygote_pid = ppid(min(pids))
    weights = gguf_mappings(zygote_pid)
    assert weights, "the zygote maps no GGUF file"
    for pid in pids:
        assert gguf_mappings(pid) == weights, pid
    assert greedy(server, 4)


@pytest.mark.timeout(180)
def test_a_killed_zygote_s_spare_takes_its_place_while_its_instances_keep_serving(start_server,
                                                                                 tmp_path: Path) -> None:
    server, zygote_pid = scalable(start_server, tmp_path, 2, 3)
    pids = worker_pids(server)
    spares = set(children(zygote_pid)) - pids  # a copy of the zygote, its weights shared, waiting
    assert len(spares) == 1, spares
    killed = spares.pop()
    os.kill(killed, signal.SIGKILL)  # a spare killed: its zygote forks another

    def another_spare() -> set[int] | None:  # one look: two could see the killed one, then none yet forked
        found = set(children(zygote_pid)) - pids
        return found if len(found) == 1 and killed not in found else None

    spares = wait_for(another_spare, 10, "another spare")
    with Client(server.admin) as client:
        stream = client.stream(PROMPTS[0], max_tokens=200, temperature=0, timeout=60)
        chunks = iter(stream)
        next(chunks)
        os.kill(zygote_pid, signal.SIGKILL)
        list(chunks)
        result = stream.result
        assert result is not None and result.usage.completion_tokens == 200 and result.timings.attempts == 1
        wait_for(lambda: any("took its place" in line for line in server.log), 30, "the spare to take its place")
        assert sum(LOADED in line for line in server.log) == 1, "the model was loaded again"
        assert worker_pids(server) == pids  # nothing was restarted: the instances outlived their zygote
        assert greedy(server, 4)
        client.control("scale", "tiny", min=3)  # a scale-up forks from the spare
        wait_for(lambda: len(worker_pids(server)) == 3, 30, "a third instance")
    added = worker_pids(server) - pids
    new_zygote = ppid(added.pop())
    assert {new_zygote} == spares and not running(zygote_pid)
    for pid in pids:  # the old zygote's orphans, killed: reaped by init, replaced by forks of the new one
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: len(w := worker_pids(server)) == 3 and not w & pids, 30, "the orphans replaced")
    assert all(ppid(pid) == new_zygote for pid in worker_pids(server))
    assert sum(LOADED in line for line in server.log) == 1, "the model was loaded again"
    assert not zombies([server.proc.pid, new_zygote])
    family = set(descendants(server.proc.pid)) | pids | {new_zygote, *descendants(new_zygote)}
    assert server.stop() == 0
    wait_for(lambda: not any(running(pid) for pid in family), 10, "no process of the server left after it stopped")
    assert not server.tracebacks(), "\n".join(server.log)


@pytest.mark.timeout(120)
def test_unloading_a_model_stops_its_zygote_and_loading_it_starts_one(start_server, tmp_path: Path) -> None:
    server, zygote_pid = scalable(start_server, tmp_path, 1, 2)
    with Client(server.admin) as client:
        client.control("unload", "tiny")
        wait_for(lambda: not running(zygote_pid), 30, "the zygote stopped with the last instance")
        assert not worker_pids(server)
        client.control("load", "tiny")
        assert client.generate(PROMPTS[0], max_tokens=4, timeout=60).usage.completion_tokens == 4
    assert ppid(min(worker_pids(server))) not in (zygote_pid, server.proc.pid)
    assert any("has no instance left: stopping its zygote" in line for line in server.log)
    assert not server.tracebacks(), "\n".join(server.log)


@pytest.mark.timeout(90)
def test_a_gpu_model_starts_from_the_fork_server_and_no_model_is_loaded_before_the_fork(start_server) -> None:
    """CUDA cannot be used across a fork: a model with GPU layers gets no zygote, and each instance loads it."""
    server = start_server("--instances", "2", "--simulate-gpus", "1x24GiB").wait_ready()
    assert any("instances start from a fork server (GPU layers" in line for line in server.log), "\n".join(server.log)
    assert not any(LOADED in line for line in server.log)
    assert all(ppid(pid) in children(server.proc.pid) for pid in worker_pids(server))
    assert greedy(server, 4)
