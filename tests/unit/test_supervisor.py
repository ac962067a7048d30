"""The supervisor's restart rules with an injected clock: backoff for workers that die on their way up, at
once for one that was up, and a halt after three failed loads in a row."""

from __future__ import annotations

import dataclasses
import faulthandler
import multiprocessing
import resource
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import wait_for

from mpserve.config import loader as cfg
from mpserve.server.supervisor import (
    BACKOFF_MAX_S,
    MAX_LOAD_FAILURES,
    MAX_START_FAILURES,
    RETIRE_KILL_S,
    Supervisor,
    restart_delay,
)
from mpserve.wire import slots
from mpserve.wire.slots import SlotState, SlotTable
from mpserve.worker.spec import EXIT_LOAD_FAILED, EngineSpec, WorkerSpec, start_mode

pytestmark = pytest.mark.timeout(20)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def supervisor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Supervisor, Clock, SlotTable]]:
    monkeypatch.setenv("PYTHONSAFEPATH", "1")  # as the supervisor sets it: gone again after the test
    table = SlotTable.create(tmp_path / "slots", 1)
    spec = WorkerSpec(0, "echo", EngineSpec("echo", 512, 1, 0), -1, "inproc://x", str(tmp_path / "slots"), 1)
    clock = Clock()
    sup = Supervisor(cfg.build(model={"path": "echo"}), [spec], table, gpus=False, clock=clock)
    yield sup, clock, table
    table.close()
    table.unlink()


def exited(code: int) -> multiprocessing.process.BaseProcess:
    """A real process that has exited with ``code``."""
    process = multiprocessing.get_context("fork").Process(target=sys.exit, args=(code,))
    process.start()
    process.join()
    return process


def _segfault() -> None:
    faulthandler.disable()  # pytest's: no traceback in the test's output, and no core file
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.raise_signal(signal.SIGSEGV)


def crashed() -> multiprocessing.process.BaseProcess:
    """A real process that died of SIGSEGV."""
    process = multiprocessing.get_context("fork").Process(target=_segfault)
    process.start()
    process.join()
    return process


def test_the_backoff_doubles_from_half_a_second_up_to_its_cap() -> None:
    assert [restart_delay(n) for n in range(8)] == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, BACKOFF_MAX_S]
    assert restart_delay(50) == BACKOFF_MAX_S


def test_a_worker_that_dies_before_registering_backs_off_and_one_that_was_up_restarts_at_once(supervisor) -> None:
    sup, clock, table = supervisor
    handle = sup.workers[0]
    for expected in (0.5, 1.0, 2.0):
        handle.process = exited(1)
        sup.reap(0)
        assert handle.restart_at == clock.now + expected
        assert table.read_all()[0].state is SlotState.DEAD
    sup.registered(0, loaded=True)
    handle.process = exited(1)
    sup.reap(0)
    assert handle.restart_at == clock.now  # it had been up: its death was the request's or the host's doing


def test_tick_restarts_a_worker_only_once_its_backoff_is_over(supervisor, monkeypatch) -> None:
    sup, clock, _ = supervisor
    started: list[int] = []
    monkeypatch.setattr(sup, "spawn", started.append)
    sup.workers[0].process = exited(1)
    sup.reap(0)
    sup.tick(clock.now + 0.4)
    assert started == []
    sup.tick(clock.now + 0.5)
    assert started == [0]


def test_three_failed_loads_in_a_row_mark_the_model_failed_and_stop_restarts(supervisor) -> None:
    sup, _, table = supervisor
    sup.load_failed(0, "bad magic")
    for _ in range(MAX_LOAD_FAILURES):
        assert sup.health["echo"].failed_message is None
        handle = sup.workers[0]
        handle.process, handle.restart_at = exited(EXIT_LOAD_FAILED), None  # as spawn() leaves it
        sup.reap(0)
    assert sup.health["echo"].failed_message == "bad magic"
    assert sup.workers[0].restart_at is None  # no restart scheduled: the model is marked failed
    assert table.read_all()[0].state is SlotState.FAILED


def test_a_retired_worker_is_removed_when_it_exits_and_its_rows_are_free_again(supervisor) -> None:
    sup, clock, table = supervisor
    handle = sup.workers[0]
    sup.registered(0, loaded=True)
    sup.retire(0)
    assert handle.kill_at == clock.now + RETIRE_KILL_S  # killed if the STOP goes unheeded
    handle.process = exited(0)
    sup.reap(0)
    assert 0 not in sup.workers and sup.next_timer() is None  # not restarted
    assert table.read_all()[0].state is SlotState.EMPTY


def test_stopping_terminates_a_worker_still_starting_at_once_and_waits_for_one_told_to_stop(supervisor) -> None:
    """A worker that has not registered was not told to stop (the broker does not know it yet): it is
    terminated at once, not after the wait; one that registered is given the wait to exit by itself."""
    sup, _, _ = supervisor
    handle = sup.workers[0]
    handle.process = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    handle.process.start()
    process = handle.process
    sup.stop_all(timeout=60.0)  # the test's 20 s timeout fails it if this waits
    assert process.exitcode == -signal.SIGTERM

    handle.registered = True  # told to stop: it exits by itself within the wait
    handle.process = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0.2,))
    handle.process.start()
    process = handle.process
    sup.stop_all(timeout=60.0)
    assert process.exitcode == 0


def test_a_model_the_broker_failed_is_not_restarted_and_its_rows_say_failed(supervisor) -> None:
    sup, clock, table = supervisor
    sup.registered(0, loaded=True)
    sup.workers[0].process = crashed()
    assert sup.reap(0) == -signal.SIGSEGV  # the broker learns how it ended ...
    assert sup.workers[0].restart_at == clock.now
    sup.model_failed("echo", "crashed its workers with SIGSEGV")  # ... and fails the model
    assert sup.workers[0].restart_at is None and sup.next_timer() is None
    assert sup.health["echo"].failed_message == "crashed its workers with SIGSEGV"
    assert table.read_all()[0].state is SlotState.FAILED


@pytest.mark.parametrize(("method", "spec_changes", "engine_changes", "zygote", "why"), [
    ("fork", {}, {}, True, "loaded once"),
    ("spawn", {}, {}, False, "start_method: spawn"),
    ("fork", {"device": 0}, {}, False, "GPU layers"),
    ("fork", {}, {"n_gpu_layers": 4}, False, "GPU layers"),
    ("fork", {"lazy": True}, {}, False, "single active backend"),
    ("fork", {"idle_timeout": 30.0}, {}, False, "idle_timeout"),
    ("fork", {}, {"path": "echo"}, False, "echo backend"),
])
def test_a_model_gets_a_zygote_only_while_its_instances_keep_its_weights_on_the_cpu(
        method: str, spec_changes: dict[str, object], engine_changes: dict[str, object], zygote: bool,
        why: str) -> None:
    engine = dataclasses.replace(EngineSpec("m.gguf", 512, 1, 0), **engine_changes)
    spec = dataclasses.replace(WorkerSpec(0, "m", engine, -1, "inproc://x", "slots", 1), **spec_changes)
    mode = start_mode(spec, method)
    assert mode.zygote is zygote and why in mode.why


def test_a_worker_that_keeps_dying_before_it_starts_fails_its_model_and_is_not_restarted(supervisor) -> None:
    sup, _, table = supervisor
    for _ in range(MAX_START_FAILURES):
        assert sup.health["echo"].failed_message is None
        handle = sup.workers[0]
        handle.process, handle.restart_at = exited(1), None  # as spawn() leaves it
        sup.reap(0)
    assert sup.health["echo"].failed_message == f"its instance exited with code 1 {MAX_START_FAILURES} times in a " \
                                                "row before it started"
    assert sup.failing == ["echo"]  # for the loop to tell the broker, which ends the queued requests
    assert sup.workers[0].restart_at is None
    assert table.read_all()[0].state is SlotState.FAILED


def test_a_worker_stopped_in_the_middle_of_a_row_update_is_found_stalled_whatever_its_row_last_said(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker stopped (or hung) mid-update leaves its row's sequence odd: a reader takes the row as it last read
    it whole, which for the watchdog may be from before the worker took its request (idle). The watchdog counts
    the time it has found the update unfinished instead, and stops the worker after the stall timeout."""
    monkeypatch.setenv("PYTHONSAFEPATH", "1")  # as the supervisor sets it: gone again after the test
    table = SlotTable.create(tmp_path / "slots", 1)
    spec = WorkerSpec(0, "echo", EngineSpec("echo", 512, 1, 0), -1, "inproc://x", str(tmp_path / "slots"), 1)
    sup = Supervisor(cfg.build(server={"stall_timeout": 1.0}, model={"path": "echo"}), [spec], table, gpus=False)
    process = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    process.start()
    try:
        sup.workers[0].process = process
        writer = table.writer(0)
        writer.update(pid=process.pid, worker=0, state=SlotState.IDLE)
        assert sup.stalled() == {}  # read whole: idle
        writer.update(state=SlotState.BUSY, request="r")  # the request came, then the worker stopped mid-update
        offset = slots._HEADER.size
        (seq,) = slots._SEQ.unpack_from(table._mm, offset)
        slots._SEQ.pack_into(table._mm, offset, seq + 1)
        found = wait_for(lambda: sup.stalled(), 10, "the watchdog to find the worker stalled")
        assert list(found) == [0] and found[0] > 1.0
        sup.stop_stalled(0)
        assert sup.stalled() == {}  # being stopped: not found again
    finally:
        process.kill()
        process.join()
        table.close()
        table.unlink()
