"""The worker's loop (mpserve.worker.loop) driven in-process: the echo engine, an inproc broker socket."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from mpserve.engine.echo import EchoEngine
from mpserve.engine.interface import Completion, Engine
from mpserve.engine.kv_events import Held
from mpserve.errors import GrammarTooComplex
from mpserve.wire import protocol as wire
from mpserve.wire.kv_events import AllBlocksCleared, BlockStored, decode_batch
from mpserve.wire.slots import SlotTable
from mpserve.worker.loop import Worker
from mpserve.worker.spec import EngineSpec, WorkerSpec

pytestmark = pytest.mark.timeout(10)


class _FailingStep(EchoEngine):
    def step(self) -> list[tuple[int, object]]:
        raise RuntimeError("llama_decode returned -1")


class _GrammarPastBudget(EchoEngine):
    """Slot 0's sequence ends as a grammar step past its budget ends it (``mpserve.engine.sampling``)."""

    def step(self) -> list[tuple[int, Completion]]:
        return [(slot, dataclasses.replace(done, finish_reason="error", error=GrammarTooComplex("past its budget"))
                 if slot == 0 else done) for slot, done in super().step()]


@pytest.fixture
def link(tmp_path: Path) -> Iterator[tuple[zmq.Socket[bytes], WorkerSpec, SlotTable]]:
    ctx = zmq.Context()
    broker = ctx.socket(zmq.ROUTER)
    broker.bind("inproc://back")
    table = SlotTable.create(tmp_path / "slots", rows=2)
    spec = WorkerSpec(index=0, model="m", engine=EngineSpec("echo", n_ctx=64, threads=1, n_gpu_layers=0, parallel=2),
                      device=-1, backend="inproc://back", slots_path=str(tmp_path / "slots"), parent_pid=os.getpid())
    try:
        yield broker, spec, table
    finally:
        table.unlink()
        table.close()
        ctx.destroy(linger=0)  # the worker's socket too


def _worker(broker: zmq.Socket[bytes], spec: WorkerSpec, table: SlotTable, engine: Engine) -> Worker:
    sock = broker.context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, spec.identity)
    sock.setsockopt(zmq.LINGER, 0)  # closed with the context: everything sent is in the broker's queue by then
    sock.connect(spec.backend)
    worker = Worker(spec, sock, [table.writer(i) for i in spec.rows], lambda _: engine)
    worker.load()
    return worker


def test_a_failed_step_answers_its_requests_before_the_worker_exits(
        link: tuple[zmq.Socket[bytes], WorkerSpec, SlotTable]) -> None:
    broker, spec, table = link
    worker = _worker(broker, spec, table, _FailingStep(parallel=2))
    assigns = [wire.Assign(f"t{i}", wire.Request(f"r{i}", "hello"), 0.0, 1, slot=i) for i in range(2)]
    broker.send_multipart([spec.identity, *wire.encode_assigns([wire.pack(a) for a in assigns])])
    with pytest.raises(SystemExit):
        worker.run()
    answers: list[tuple[wire.MsgType, str, object]] = []
    while broker.poll(1000):
        frames = broker.recv_multipart()[1:]
        mtype = wire.parse_header(frames, len(frames))
        if mtype is wire.MsgType.STEP:
            answers += [(t, ticket, wire.decode_body(t, body)) for t, ticket, body, _ in wire.step_entries(frames[3])]
        elif mtype is not wire.MsgType.READY:
            answers.append((mtype, frames[2].decode(), wire.decode_body(mtype, frames[3])))
        if len(answers) == 2:
            break
    assert sorted(ticket for _, ticket, _ in answers) == ["t0", "t1"]
    assert all(t is wire.MsgType.ERROR and m.code == "internal" for t, _, m in answers), answers


def _two_requests_then_stop(broker: zmq.Socket[bytes], spec: WorkerSpec, worker: Worker) -> None:
    """Two one-token requests in slots 0 and 1, then STOP, run through ``worker`` to its end."""
    assigns = [wire.Assign(f"t{i}", wire.Request(f"r{i}", "hi", params=wire.GenerateParams(max_tokens=1)), 0.0, 1,
                           slot=i) for i in range(2)]
    broker.send_multipart([spec.identity, *wire.encode_assigns([wire.pack(a) for a in assigns])])
    broker.send_multipart([spec.identity, *wire.encode(wire.Stop("done"))])
    worker.run()


def test_the_answers_of_one_step_travel_as_one_step_message(
        link: tuple[zmq.Socket[bytes], WorkerSpec, SlotTable]) -> None:
    broker, spec, table = link
    _two_requests_then_stop(broker, spec, _worker(broker, spec, table, EchoEngine(parallel=2)))
    kinds = []
    while broker.poll(500):
        frames = broker.recv_multipart()[1:]
        kinds.append(wire.parse_header(frames, len(frames)))
        if kinds[-1] is wire.MsgType.STEP:
            entries = wire.step_entries(frames[3])
            assert [(t, ticket) for t, ticket, _, _ in entries] == [(wire.MsgType.DONE, f"t{i}") for i in range(2)]
    assert wire.MsgType.STEP in kinds and wire.MsgType.DONE not in kinds, kinds


def test_a_sequence_ended_by_its_grammars_budget_is_an_error_of_that_code_and_its_neighbour_is_done(
        link: tuple[zmq.Socket[bytes], WorkerSpec, SlotTable]) -> None:
    broker, spec, table = link
    _two_requests_then_stop(broker, spec, _worker(broker, spec, table, _GrammarPastBudget(parallel=2)))
    answers = {}
    while broker.poll(500):
        frames = broker.recv_multipart()[1:]
        if wire.parse_header(frames, len(frames)) is wire.MsgType.STEP:
            answers |= {ticket: wire.decode_body(t, body) for t, ticket, body, _ in wire.step_entries(frames[3])}
    refused, done = answers["t0"], answers["t1"]
    assert isinstance(refused, wire.Error) and (refused.code, refused.message) == ("grammar_too_complex",
                                                                                   "past its budget"), refused
    assert isinstance(done, wire.Done) and done.id == "r1", done


def test_a_worker_stopping_with_a_request_running_leaves_without_answering_it(
        link: tuple[zmq.Socket[bytes], WorkerSpec, SlotTable]) -> None:
    """The broker hands such a request over (LEAVING); an answer would end it for its client."""
    broker, spec, table = link
    worker = _worker(broker, spec, table, EchoEngine(parallel=2))
    assign = wire.Assign("t0", wire.Request("r0", "hi", params=wire.GenerateParams(max_tokens=1000)), 0.0, 1)
    broker.send_multipart([spec.identity, *wire.encode_assigns([wire.pack(assign)])])
    broker.send_multipart([spec.identity, *wire.encode(wire.Stop("scaled down"))])
    worker.run()
    sent = []
    while broker.poll(500):
        frames = broker.recv_multipart()[1:]
        mtype = wire.parse_header(frames, len(frames))
        sent.append(wire.decode_body(mtype, frames[3]) if mtype is not wire.MsgType.STEP else mtype)
    assert not [m for m in sent if isinstance(m, (wire.Done, wire.Error))], sent
    assert sent[-1] == wire.Leaving("w0", "told to stop")


class _GrowingCells(EchoEngine):
    """Slot 0's cells gain a block each time they are read: every turn of the loop has something to tell."""

    reads = 0

    def kv_held(self) -> list[Held]:
        self.reads += 1
        return [Held(list(range(16 * self.reads))), Held([])]

    def kv_stored(self) -> list[tuple[str, Held | None]]:
        return []


def test_the_loop_publishes_its_engine_s_kv_events_each_turn_and_clears_them_as_it_leaves(
        link: tuple[zmq.Socket[bytes], WorkerSpec, SlotTable], tmp_path: Path) -> None:
    broker, spec, table = link
    spec = dataclasses.replace(spec, kv_events=f"ipc://{tmp_path}/kv", heartbeat_interval=0.05)
    worker = _worker(broker, spec, table, _GrowingCells(parallel=2))
    sub = broker.context.socket(zmq.SUB)
    sub.connect(f"ipc://{tmp_path}/kv-w0")
    sub.subscribe(b"kv@")
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        assert sub.poll(5000), "no batch from an idle worker's turns"
        first = decode_batch(sub.recv_multipart()[2])
        assert first.data_parallel_rank == 0 and isinstance(first.events[-1], BlockStored)
    finally:
        broker.send_multipart([spec.identity, *wire.encode(wire.Stop("done"))])
        runner.join(5)
    events = []
    while sub.poll(1000):
        events += decode_batch(sub.recv_multipart()[2]).events
    assert isinstance(events[-1], AllBlocksCleared)  # it left: its cells are gone
