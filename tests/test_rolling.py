"""A reload that changes what a model's instances run (``mpserve.server.rolling``): the context size and the batch
roll one instance at a time, forked from the zygote that holds the weights (nothing is loaded again); a new file
for the model is a blue/green swap (a new zygote loads it while the old instances serve). Under a steady load of
streams, none fails, and each finishes whole."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import yaml
from conftest import ServerProcess
from helpers import mpserve, wait_for

from mpserve.client import Client
from mpserve.errors import MpserveError

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 48


def _load(address: str, stop: threading.Event, failures: list[str], done: list[int], seed: int) -> None:
    """Greedy streams one after another until ``stop``: each must end whole (MAX_TOKENS tokens)."""
    with Client(address, timeout=120) as client:
        i = seed
        while not stop.is_set():
            try:
                stream = client.stream(f"Story {i}: once upon a time", model="tiny", max_tokens=MAX_TOKENS,
                                       temperature=0)
                pieces = list(stream)
                assert stream.result is not None
                if stream.result.usage.completion_tokens != MAX_TOKENS or not "".join(pieces):
                    failures.append(f"request {i}: {stream.result.usage.completion_tokens} tokens")
                done[0] += 1
            except MpserveError as exc:
                failures.append(f"request {i}: {exc.code}: {exc.message}")
            i += 4


def _rolled(server: ServerProcess, settings: str) -> bool:
    status = mpserve("status", "--server-name", server.name).stdout
    return f"model tiny: {settings}" in status and "rolling" not in status


def test_a_reload_rolls_the_context_and_then_the_file_under_load_with_no_request_failed(
        start_server, tiny_model_path: str, tmp_path: Path) -> None:
    config = tmp_path / "pool.yaml"
    model = {"name": "tiny", "path": tiny_model_path, "instances": 2, "parallel": 2, "n_ctx": 256}
    config.write_text(yaml.safe_dump({"spare_slots": 8, "models": [model]}))
    server: ServerProcess = start_server("--config", str(config)).wait_ready()
    stop, failures, done = threading.Event(), [], [0]
    threads = [threading.Thread(target=_load, args=(server.address, stop, failures, done, i)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: done[0] >= 4, 60, "the load to run")
        config.write_text(yaml.safe_dump({"spare_slots": 8, "models": [{**model, "n_ctx": 512, "parallel": 4}]}))
        answer = mpserve("reload", "--server-name", server.name)
        assert answer.returncode == 0, answer.stderr
        assert "models[tiny]: n_ctx 256 -> 512, parallel 2 -> 4: rolling (its instances replaced one at a time)" \
            in answer.stdout.splitlines()
        wait_for(lambda: _rolled(server, f"{tiny_model_path}, n_ctx 512, parallel 4"), 120, "the context to roll")
        rows = [r for r in server.slots() if r.pid and r.model == "tiny"]
        assert len(rows) == 8 and {r.kv_capacity for r in rows} == {512}, rows  # 2 instances × parallel 4
        loads = [line for line in server.log if "instances are forked from here" in line]
        assert len(loads) == 1, "\n".join(server.log)  # forked from the zygote of the start: nothing loaded again

        before = done[0]
        other = tmp_path / "other.gguf"  # a new file for the model (the same bytes: the same texts)
        other.write_bytes(Path(tiny_model_path).read_bytes())
        config.write_text(yaml.safe_dump({"spare_slots": 8, "models": [
            {**model, "n_ctx": 512, "parallel": 4, "path": str(other)}]}))
        answer = mpserve("reload", "--server-name", server.name)
        assert answer.returncode == 0, answer.stderr
        wait_for(lambda: _rolled(server, f"{other}, n_ctx 512, parallel 4"), 120, "the file to roll")
        assert any("stopping the zygote that holds the old ones" in line for line in server.log)
        assert len([line for line in server.log if "instances are forked from here" in line]) == 2
        wait_for(lambda: done[0] >= before + 8, 60, "the load to go on over the new file")
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert failures == []
    assert not server.tracebacks(), "\n".join(server.log)


def test_a_roll_that_needs_more_slot_rows_than_are_free_is_refused_whole(start_server, tmp_path: Path) -> None:
    config = tmp_path / "pool.yaml"
    model = {"name": "e", "path": "echo", "instances": 2, "parallel": 2}
    config.write_text(yaml.safe_dump({"max_queue": 64, "models": [model]}))
    server: ServerProcess = start_server("--config", str(config)).wait_ready()
    config.write_text(yaml.safe_dump({"max_queue": 32, "models": [{**model, "parallel": 4}]}))
    refused = mpserve("reload", "--server-name", server.name)
    assert refused.returncode == 1
    assert "parallel 2 -> 4: the roll of its 2 instances needs 8 free slot-table rows, and the table has 0 free; " \
        "start the server with a larger --spare-slots" in refused.stderr
    assert not any("max_queue: 64 -> 32" in line for line in server.log)  # refused whole: nothing applied
    with Client(server.address, timeout=30) as client:
        assert client.generate("hello", model="e", max_tokens=4).text


def test_a_roll_whose_new_settings_do_not_fit_where_the_old_ran_is_refused_whole(start_server, tmp_path: Path) -> None:
    config = tmp_path / "pool.yaml"
    model = {"name": "tiny", "path": "builtin:tiny", "instances": 2}
    config.write_text(yaml.safe_dump({"models": [model]}))
    server: ServerProcess = start_server("--config", str(config), "--simulate-gpus", "1x24GiB").wait_ready()
    config.write_text(yaml.safe_dump({"models": [{**model, "requires": {"memory": "16GiB"}}]}))  # two do not fit
    refused = mpserve("reload", "--server-name", server.name)
    assert refused.returncode == 1 and "does_not_fit" in refused.stderr, refused.stderr
    assert "model tiny: builtin:tiny, n_ctx 2048" in mpserve("status", "--server-name", server.name).stdout
    with Client(server.address, timeout=30) as client:
        assert client.generate("hello", model="tiny", max_tokens=4).text
