"""GPU placement and exclusivity on simulated GPUs: everything but the CUDA calls runs as on a GPU host
(device discovery, placement, host-wide permits, single active backend)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from helpers import LOADED, children, config_file, live_environ, load, mpserve, wait_for

from mpserve import Client
from mpserve.client import Result
from mpserve.errors import MpserveError
from mpserve.gpu.permits import max_concurrent, read_holds
from mpserve.wire.slots import SlotState

SWITCH_BATCH = 1  # under the two slots of each model: a resident must stop at its batch with slots still free


@pytest.mark.timeout(120)
def test_exclusive_mode_across_two_servers_sharing_one_gpu(start_server, tmp_path: Path) -> None:
    log = tmp_path / "holds.log"
    servers = [start_server("--config", config_file(tmp_path, f"s{i}", permit_log=str(log)), "--instances", "2",
                            "--simulate-gpus", "1x24GiB", "--gpu-mode", "exclusive").wait_ready() for i in range(2)]

    async def both() -> list[list[object]]:
        return await asyncio.gather(*(load(s.address, 8, 64, 4) for s in servers))

    outcomes = asyncio.run(both())
    assert all(not isinstance(o, BaseException) for per_server in outcomes for o in per_server), outcomes
    holds = read_holds(log)
    pids = [{r.pid for r in s.slots()} for s in servers]
    per_server = [sum(1 for h in holds if h.pid in p) for p in pids]
    assert len(holds) == 16 and per_server == [8, 8]
    assert max_concurrent(holds) == 1  # never two requests computing on the GPU at once
    assert all(r.device == 0 for s in servers for r in s.slots())


@pytest.mark.timeout(120)
def test_max_active_per_gpu_caps_concurrent_computation(start_server, tmp_path: Path) -> None:
    log = tmp_path / "holds.log"
    server = start_server("--config", config_file(tmp_path, "s", permit_log=str(log)), "--instances", "4",
                          "--simulate-gpus", "1x24GiB", "--max-active-per-gpu", "2").wait_ready()
    outcomes = asyncio.run(load(server.address, 16, 200, 8))
    assert all(not isinstance(o, BaseException) for o in outcomes), outcomes
    holds = read_holds(log)
    assert len(holds) == 16 and max_concurrent(holds) == 2


@pytest.mark.timeout(180)
def test_sigkilled_permit_holder_hands_over_to_the_next_waiter_within_a_second(start_server, tmp_path) -> None:
    server = start_server("--instances", "2", "--simulate-gpus", "1x24GiB", "--gpu-mode", "exclusive",
                          "--n-ctx", "4096").wait_ready()
    stop = threading.Event()
    client = Client(server.address, timeout=120)
    refused: list[MpserveError] = []

    def keep_busy() -> None:
        while not stop.is_set():
            try:
                client.generate("busy", max_tokens=3000, temperature=0)
            except MpserveError as exc:  # a SIGKILL hands a request over: it may only hit the bound on that
                refused.append(exc)

    threads = [threading.Thread(target=keep_busy, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    handovers = []
    try:
        for _ in range(20):
            holder, waiter = _holder_and_waiter(server)
            os.kill(holder.pid, signal.SIGKILL)
            killed = time.monotonic()
            while server.slots()[waiter.index].state is not SlotState.BUSY:
                assert time.monotonic() - killed < 5, "the waiter never got the permit"
                time.sleep(0.002)
            handovers.append(time.monotonic() - killed)
    finally:
        stop.set()
        client.close()
        for t in threads:
            t.join(30)
    print(f"\npermit handover after SIGKILL: max {max(handovers) * 1000:.0f} ms, "
          f"median {sorted(handovers)[len(handovers) // 2] * 1000:.0f} ms over {len(handovers)} kills")
    assert len(handovers) == 20 and max(handovers) < 1.0
    closed = [e for e in refused if e.code == "connection" and "client was closed" in e.message]  # at the end
    bound = [e for e in refused if e.code == "worker_lost" and "the bound on hand-overs" in e.message]
    assert len(closed) + len(bound) == len(refused) and len(closed) <= len(threads), refused


def _holder_and_waiter(server, timeout: float = 20.0):
    """Wait until one worker computes (holds the permit) and the other waits for it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = server.slots()
        states = {r.state for r in rows}
        if states == {SlotState.BUSY, SlotState.WAITING}:
            holder = next(r for r in rows if r.state is SlotState.BUSY)
            waiter = next(r for r in rows if r.state is SlotState.WAITING)
            return holder, waiter
        time.sleep(0.005)
    raise AssertionError(f"no holder and waiter: {server.slots()}\n" + "\n".join(server.log[-30:]))


@pytest.mark.timeout(180)
def test_single_active_backend_serves_both_models_one_resident_at_a_time(start_server, tmp_path: Path) -> None:
    """At most one model resident at any time, and fair turns: once a request of one model waits, the other
    starts at most ``switch_batch`` requests before the waiting model starts one. Judged on the broker's own
    order of queueing and starts (its debug log): times taken by the client would not order them."""
    config = config_file(tmp_path, "sab", switch_batch=SWITCH_BATCH, models=[
        {"name": "a", "path": "builtin:tiny", "instances": 2}, {"name": "b", "path": "builtin:tiny", "instances": 2}])
    server = start_server("--config", config, "--simulate-gpus", "1x24GiB", "--single-active-backend",
                          "--log-level", "debug").wait_ready()
    assert all(r.state is SlotState.UNLOADED for r in server.slots())  # nothing loads before it is asked for

    residents: list[set[str]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            residents.append({r.model for r in server.slots() if r.state in LOADED})
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        outcomes = asyncio.run(load(server.address, 40, 32, 6, models=["a", "b"]))
    finally:
        stop.set()
        watcher.join()
    results = [o for o in outcomes if isinstance(o, Result)]
    assert len(results) == 40, outcomes
    assert max(len(models) for models in residents) == 1  # at most one model resident on the GPU
    seen = {m for models in residents for m in models}
    assert seen == {"a", "b"}
    events = wait_for(lambda: _queued_and_started(server.log, 40), 10, "the broker's log of 40 requests")
    passed = _most_started_while_another_waited(events)
    assert passed <= SWITCH_BATCH, events
    with Client(server.address) as client:  # each switch counted once: /metrics' single_active_swaps event
        swaps = client.stats().counters.get("single_active_swaps")
    assert swaps == sum(": a is resident now (after b)" in line or ": b is resident now (after a)" in line
                        for line in server.log) >= 1, "\n".join(server.log)
    switches = sum(1 for x, y in zip(residents, residents[1:], strict=False) if x and y and x != y)
    print(f"\nsingle active backend: 40 requests, residents sampled {len(residents)} times, ~{switches} switches; "
          f"the most requests of one model started while the other waited: {passed}")


BROKER_EVENT = re.compile(r"mpserve\.broker: request \S+ of (\S+): (queued|started)")


def _queued_and_started(log: list[str], requests: int) -> list[tuple[str, str]] | None:
    """The broker's (event, model) for each request queued and each started, in its order; None until all
    ``requests`` have started (the server's log is read by a thread of its own)."""
    events = [(m[2], m[1]) for line in list(log) if (m := BROKER_EVENT.search(line))]
    return events if sum(what == "started" for what, _ in events) == requests else None


def _most_started_while_another_waited(events: list[tuple[str, str]]) -> int:
    """The most requests of the other model started between a request's queueing and the next start of its own
    model: what the broker's turns bound by ``switch_batch`` (the resident drains after that many while another
    model waits, and the next resident starts its requests at once)."""
    most = 0
    for k, (what, model) in enumerate(events):
        if what == "queued":
            later = [other for event, other in events[k + 1:] if event == "started"]
            own = later.index(model) if model in later else len(later)
            most = max(most, own)
    return most


@pytest.mark.timeout(60)
def test_a_model_over_the_budget_is_refused_before_anything_starts() -> None:
    args = ["--model", "builtin:bench", "--instances", "3", "--simulate-gpus", "1x2GiB"]
    planned = mpserve("plan", *args)
    assert planned.returncode == 1
    for part in ("does_not_fit", "'bench'", "GPU 0", "needs", "available", "n_ctx", "n_gpu_layers"):
        assert part in planned.stderr, planned.stderr
    started = mpserve("start", *args, "--server-name", "too-big")
    assert started.returncode == 1 and "does_not_fit" in started.stderr and "Traceback" not in started.stderr
    budget = mpserve("plan", "--model", "builtin:tiny", "--simulate-gpus", "1x24GiB", "--gpu-memory-budget", "100MiB")
    assert budget.returncode == 1 and "does_not_fit" in budget.stderr
    fits = mpserve("plan", "--model", "builtin:tiny", "--instances", "3", "--simulate-gpus", "2x24GiB")
    assert fits.returncode == 0 and fits.stdout.count("GPU 0") >= 2 and "GPU 1" in fits.stdout


@pytest.mark.timeout(60)
def test_devices_lists_simulated_gpus_with_permit_holders(start_server) -> None:
    server = start_server("--instances", "1", "--simulate-gpus", "2x24GiB", "--gpu-mode", "exclusive",
                          "--gpus", "1", "--n-ctx", "4096").wait_ready()
    assert [r.device for r in server.slots()] == [1]
    assert live_environ(server.slots()[0].pid)["CUDA_VISIBLE_DEVICES"] == "1"  # the GPU it was placed on
    with Client(server.address) as client:
        stream = client.stream("hold it", max_tokens=3000, temperature=0)
        chunks = iter(stream)
        next(chunks)  # computing now: the worker holds GPU 1's permit
        listed = json.loads(mpserve("devices", "--simulate-gpus", "2x24GiB", "--json").stdout)
        client.cancel(stream.id)
    assert [d["index"] for d in listed] == [0, 1]
    assert listed[0]["holders"] == [] and listed[1]["holders"] == [server.slots()[0].pid]
    assert listed[1]["permit_capacity"] == 1


def _maps_llama(pid: int) -> bool:
    return "libllama" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("gpus", [False, True], ids=["cpu_host", "gpu_host"])
def test_the_fork_server_imports_llama_cpp_only_on_a_host_without_gpus(start_server, gpus: bool) -> None:
    """Workers are forked from a fork server. Where a worker may use a GPU, llama.cpp must be loaded in the
    worker after it sets CUDA_VISIBLE_DEVICES, so the fork server must not have loaded it; without GPUs it
    has, and the workers, forked from their model's zygote (a child of the fork server), share its pages.
    Each worker's environment, as the CUDA runtime would read it, names its own GPU only (in PCI bus order),
    and none on the CPU host."""
    server = start_server("--instances", "2", *(["--simulate-gpus", "2x24GiB"] if gpus else [])).wait_ready()
    rows = server.slots()
    assert sorted(r.device for r in rows) == ([0, 1] if gpus else [-1, -1])
    for row in rows:
        env = live_environ(row.pid)
        cuda = {name: env.get(name) for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
        assert cuda == {"CUDA_VISIBLE_DEVICES": str(row.device) if gpus else "", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, row
    workers = {r.pid for r in rows}
    below = [pid for child in children(server.proc.pid) for pid in (child, *children(child))]
    parents = {pid for pid in below if workers & set(children(pid))}
    assert len(parents) == 1, parents
    fork_servers = [pid for pid in children(server.proc.pid) if parents & {pid, *children(pid)}]
    assert len(fork_servers) == 1, fork_servers
    assert _maps_llama(fork_servers[0]) is not gpus
    assert (parents == {fork_servers[0]}) is gpus  # a zygote (the fork server's child) on the CPU host
    assert all(_maps_llama(pid) for pid in workers)
    with Client(server.address) as client:
        assert client.generate("after the fork", max_tokens=4, temperature=0, timeout=30).usage.completion_tokens == 4
