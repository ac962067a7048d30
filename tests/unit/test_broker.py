"""The broker's bookkeeping of worker registrations, driven directly (no processes)."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from mpserve.errors import ErrorCode
from mpserve.server.broker import Broker
from mpserve.server.hooks import BrokerHooks
from mpserve.server.routing import MAX_HANDOVERS, MODEL_CRASHES
from mpserve.server.state import WorkerEntry
from mpserve.wire import protocol as wire
from mpserve.wire.adapters import Served
from mpserve.wire.prefix import block_hashes
from mpserve.wire.salt import reuse_salt

pytestmark = pytest.mark.timeout(10)


@pytest.fixture
def broker() -> Iterator[Broker]:
    ctx = zmq.Context()
    broker = Broker(ctx, "inproc://front", "inproc://back", {"m": 8}, admin_addr="inproc://admin")
    yield broker
    broker.front.close(0)
    broker.back.close(0)
    assert broker.admin is not None
    broker.admin.close(0)
    ctx.term()


class Ready(BrokerHooks):
    """The server's hooks as far as READY goes: each local instance's registration, as the supervisor hears it."""

    def __init__(self) -> None:
        self.seen: list[tuple[int | None, bool]] = []

    def worker_ready(self, entry: WorkerEntry) -> None:
        self.seen.append((entry.index, entry.loaded))


class Loading(BrokerHooks):
    """The server's hooks as far as loading goes: whether an instance is starting, as the test says."""

    def __init__(self) -> None:
        self.starting = True

    def loading(self, model: str) -> bool:
        return self.starting


def test_a_worker_that_loads_on_demand_registers_again_and_counts_as_a_good_load() -> None:
    ctx = zmq.Context()
    hooks = Ready()
    broker = Broker(ctx, "inproc://front-ready", "inproc://back-ready", {"m": 8}, hooks=hooks)
    try:
        ready = wire.Ready("w0", "m", -1, 2, 1234, loaded=False, proof=broker.link_secret)
        broker.registry.register(b"w0", ready, None)
        assert hooks.seen == [(0, False)] and len(broker.tables.models["m"].free) == 2
        broker.registry.register(b"w0", ready, None)  # registering again after a silence: nothing new
        assert hooks.seen == [(0, False)]
        broker.registry.register(b"w0", wire.Ready("w0", "m", -1, 2, 1234, loaded=True, chat_template="{{ x }}",
                                                   proof=broker.link_secret), None)
        assert hooks.seen == [(0, False), (0, True)]  # the supervisor hears of the good load
        assert len(broker.tables.models["m"].free) == 2 and broker.tables.workers[b"w0"].loaded
        assert broker.snapshot().models["m"].chat_template == "{{ x }}"
    finally:
        broker.front.close(0)
        broker.back.close(0)
        ctx.term()


def test_a_new_process_takes_a_local_name_only_once_the_old_one_has_exited(broker: Broker) -> None:
    broker.registry.register(b"w0", wire.Ready("w0", "m", -1, 1, 1234, proof=broker.link_secret), None)
    first: WorkerEntry = broker.tables.workers[b"w0"]
    broker.registry.register(b"w0", wire.Ready("w0", "m", -1, 1, 5678, proof=broker.link_secret), None)
    assert broker.tables.workers[b"w0"] is first and broker.tables.stats["refused_worker_ready"] == 1  # w0 lives
    broker.worker_exited(0, 0)
    broker.registry.register(b"w0", wire.Ready("w0", "m", -1, 1, 5678, proof=broker.link_secret), None)
    assert broker.tables.workers[b"w0"] is not first and broker.tables.workers[b"w0"].pid == 5678
    assert len(broker.tables.models["m"].free) == 1


@contextlib.contextmanager
def peers(broker: Broker, slots: int) -> Iterator[tuple[zmq.Socket[bytes], dict[bytes, zmq.Socket[bytes]]]]:
    """A client on the front and two workers, w0 and w1 with ``slots`` slots each, on the back."""
    ctx = broker.front.context
    client = ctx.socket(zmq.DEALER)
    client.connect("inproc://front")
    workers = {}
    for name in (b"w0", b"w1"):
        workers[name] = ctx.socket(zmq.DEALER)
        workers[name].setsockopt(zmq.IDENTITY, name)
        workers[name].connect("inproc://back")
        broker.registry.register(name, wire.Ready(name.decode(), "m", -1, slots, 1, proof=broker.link_secret), None)
    try:
        yield client, workers
    finally:
        client.close(0)
        for sock in workers.values():
            sock.close(0)


def assigns(sock: zmq.Socket[bytes], n: int) -> list[wire.Assign]:
    """The next ``n`` assignments a fake worker gets, each message an ASSIGN or an ASSIGNS."""
    got: list[wire.Assign] = []
    while len(got) < n:
        assert sock.poll(1000), f"{len(got)} of {n} assignments came"
        msg = wire.decode(sock.recv_multipart())
        got.extend(msg.assigns if isinstance(msg, wire.Assigns) else [msg])
    assert len(got) == n
    return got


def test_a_streamed_request_whose_worker_dies_is_resumed_elsewhere_from_its_tokens(broker: Broker) -> None:
    with peers(broker, slots=1) as (client, workers):
        client.send_multipart(wire.encode(wire.Request("r1", "hi", stream=True)))
        assert broker.front.poll(1000)
        broker.drain_front()
        first = next(name for name, sock in workers.items() if sock.poll(1000))
        assign = wire.decode(workers[first].recv_multipart())
        assert assign.report_tokens and assign.generated == b"" and assign.attempt == 1
        chunk = wire.encode_from_worker(wire.Chunk("r1", "ab"), assign.ticket, wire.token_frame([7, 8]))
        workers[first].send_multipart(chunk)
        assert broker.back.poll(1000)
        broker.drain_back()
        assert client.poll(1000) and wire.decode(client.recv_multipart()) == wire.Chunk("r1", "ab")

        broker.worker_exited(int(first[1:]), -signal.SIGKILL)  # it died after streaming: handed over, not worker_lost
        other = workers[b"w1" if first == b"w0" else b"w0"]
        assert other.poll(1000)
        resumed = wire.decode(other.recv_multipart())
        assert wire.frame_tokens(resumed.generated) == [7, 8] and resumed.attempt == 2
        stats = broker.tables.stats
        assert resumed.ticket == assign.ticket and stats["resumed"] == 1 and not stats["worker_lost"]
        assert not client.poll(0)  # the client saw no error


def test_a_request_for_more_choices_than_a_later_instance_has_is_answered_not_left_queued(broker: Broker) -> None:
    client = broker.front.context.socket(zmq.DEALER)
    client.connect("inproc://front")
    try:
        client.send_multipart(wire.encode(wire.Request("r1", "hi", params=wire.GenerateParams(n=4))))
        while not broker.tables.models["m"].queue:  # accepted: no instance has registered to say how many slots it has
            broker.drain_front()
        assert len(broker.tables.requests) == 4 and broker.snapshot().models["m"].queued == 1
        broker.registry.register(b"w0", wire.Ready("w0", "m", -1, 2, 1234, proof=broker.link_secret), None)
        assert client.poll(2000)
        answer = wire.decode(client.recv_multipart())
        assert isinstance(answer, wire.Error) and answer.id == "r1" and "'n' = 4 is more than the 2 slots" in (
            answer.message)
        assert not broker.tables.requests and not broker.tables.by_client and not broker.tables.models["m"].queue
        assert len(broker.tables.models["m"].free) == 2
    finally:
        client.close(0)


def test_the_choices_of_a_request_whose_worker_dies_are_handed_over_each_with_its_index(broker: Broker) -> None:
    with peers(broker, slots=2) as (client, workers):
        client.send_multipart(wire.encode(wire.Request("r1", "hi", params=wire.GenerateParams(n=2, seed=5),
                                                       stream=True)))
        assert broker.front.poll(1000)
        broker.drain_front()
        first = next(name for name, sock in workers.items() if sock.poll(1000))
        given = sorted(assigns(workers[first], 2), key=lambda a: a.index)
        assert [(a.index, a.request.params.seed) for a in given] == [(0, 5), (1, 6)]  # together, on one instance
        workers[first].send_multipart(wire.encode_from_worker(wire.Chunk("r1", "ab", index=1), given[1].ticket,
                                                              wire.token_frame([7, 8])))
        assert broker.back.poll(1000)
        broker.drain_back()
        assert client.poll(1000) and wire.decode(client.recv_multipart()) == wire.Chunk("r1", "ab", index=1)

        broker.worker_exited(int(first[1:]), -signal.SIGKILL)  # each choice goes on alone, from its own tokens
        other = workers[b"w1" if first == b"w0" else b"w0"]
        resumed = {a.index: a for a in assigns(other, 2)}
        assert wire.frame_tokens(resumed[1].generated) == [7, 8] and resumed[0].generated == b""
        assert resumed[1].request.params.seed == 6 and resumed[1].ticket == given[1].ticket
        assert broker.tables.stats["resumed"] == 1 and broker.tables.stats["retried"] == 1 and not client.poll(0)


def test_a_workers_chunks_reach_each_client_in_order_as_one_message_and_before_done(broker: Broker) -> None:
    ctx = broker.front.context
    clients = [ctx.socket(zmq.DEALER) for _ in range(2)]
    worker = ctx.socket(zmq.DEALER)
    worker.setsockopt(zmq.IDENTITY, b"w0")
    worker.connect("inproc://back")
    broker.registry.register(b"w0", wire.Ready("w0", "m", -1, 3, 1, proof=broker.link_secret), None)
    try:
        for client, ids in zip(clients, (("a1", "a2"), ("b1",)), strict=True):
            client.connect("inproc://front")
            for rid in ids:
                client.send_multipart(wire.encode(wire.Request(rid, "hi", stream=True)))
            assert broker.front.poll(1000)
            while broker.front.poll(100):
                broker.drain_front()
        tickets = {a.request.id: a.ticket for a in assigns(worker, 3)}
        step = [(wire.MsgType.CHUNK, tickets[rid], wire.pack(wire.Chunk(rid, text)), wire.token_frame([n]))
                for n, (rid, text) in enumerate((("a1", "x"), ("b1", "y"), ("a2", "z")))]
        worker.send_multipart(wire.encode_step(step))
        worker.send_multipart(wire.encode_from_worker(
            wire.Done("a1", "x", "length", wire.Usage(1, 1), wire.Timings(0, 0, 0)), tickets["a1"]))
        assert broker.back.poll(1000)
        while broker.back.poll(100):
            broker.drain_back()
        assert wire.decode(clients[0].recv_multipart()) == wire.Chunks((wire.Chunk("a1", "x"), wire.Chunk("a2", "z")))
        assert isinstance(wire.decode(clients[0].recv_multipart()), wire.Done)
        assert wire.decode(clients[1].recv_multipart()) == wire.Chunk("b1", "y")  # alone: a plain CHUNK
        assert broker.tables.requests[tickets["a2"]].generated.endswith(wire.token_frame([2]))
    finally:
        for sock in (*clients, worker):
            sock.close(0)


def test_cache_frames_say_what_the_host_store_holds_for_every_instance_there_and_the_view_outlives_them(
        broker: Broker) -> None:
    document = "".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog. " for i in range(60))
    question = document + " Summarize it."
    held = wire.CacheChanges(((1, wire.pack_hashes(block_hashes(document))),))

    def served_by(workers: dict[bytes, zmq.Socket[bytes]], client: zmq.Socket[bytes], rid: str, prompt: str,
                  cache: wire.CacheChanges | None = None) -> bytes:
        """Send ``rid``, answer it from the worker it went to (its DONE carrying ``cache``), and say which
        worker that was."""
        client.send_multipart(wire.encode(wire.Request(rid, prompt)))
        assert broker.front.poll(1000)
        broker.drain_front()
        name = next(name for name, sock in workers.items() if sock.poll(1000))
        assign = wire.decode(workers[name].recv_multipart())
        done = wire.Done(rid, "ok", "length", wire.Usage(1, 1), wire.Timings(0, 0, 0))
        workers[name].send_multipart(wire.encode_from_worker(done, assign.ticket,
                                                             wire.pack(cache) if cache is not None else None))
        assert broker.back.poll(1000)
        broker.drain_back()
        assert client.poll(1000) and wire.decode(client.recv_multipart()) == done  # forwarded as it came
        return name

    with peers(broker, slots=1) as (client, workers):
        first = served_by(workers, client, "r1", "an unrelated prompt", held)  # it saved the document
        assert all(w.ram for w in broker.tables.workers.values()) and broker.tables.stats["routed_least_busy"] == 1
        served_by(workers, client, "r2", question)  # either instance restores it from the host's store
        assert broker.tables.stats["routed_ram_prefix"] == 1

        workers[first].send_multipart(wire.encode_from_worker(wire.Unloaded(first.decode())))
        assert broker.back.poll(1000)
        broker.drain_back()
        entry = broker.tables.workers[first]
        assert entry.ram and not entry.prompts  # the store keeps what it saved

        bad = wire.encode_from_worker(wire.Done("x", "", "stop", wire.Usage(0, 0), wire.Timings(0, 0, 0)), "nope",
                                      wire.pack({"added": [[1, b"\x00" * 7]]}))
        workers[first].send_multipart(bad)  # a broken CACHE frame is counted; the result goes its way
        assert broker.back.poll(1000)
        broker.drain_back()
        assert broker.tables.stats["dropped_worker_malformed"] == 1

        broker.worker_exited(int(first[1:]), -signal.SIGKILL)  # a lost worker: the store outlives it
        assert first not in broker.tables.workers and broker.tables.models["m"].store("")


def test_a_worker_registering_with_its_hosts_store_steers_routing_to_that_host(broker: Broker) -> None:
    """A broker that restarted, or a new instance, learns what a host's store holds when the worker registers:
    its READY carries the store's entries, and the view is that host's."""
    document = "".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog. " for i in range(60))
    held = wire.pack(wire.CacheChanges(((7, wire.pack_hashes(block_hashes(document))),)))

    def register(workers: dict[bytes, zmq.Socket[bytes]], name: bytes, pid: int, cache: bytes | None,
                 host: str = "") -> None:
        ready = wire.Ready(name.decode(), "m", -1, 1, pid, host=host, proof=broker.link_secret)
        workers[name].send_multipart(wire.encode_from_worker(ready, "", cache))
        assert broker.back.poll(1000)
        broker.drain_back()
        assert isinstance(wire.decode(workers[name].recv_multipart()), wire.Heartbeat)  # a remote one's: answered

    def routed(client: zmq.Socket[bytes], workers: dict[bytes, zmq.Socket[bytes]], rid: str) -> bytes:
        client.send_multipart(wire.encode(wire.Request(rid, document + " Summarize it.")))
        assert broker.front.poll(1000)
        broker.drain_front()
        name = next(name for name, sock in workers.items() if sock.poll(1000))
        assign = wire.decode(workers[name].recv_multipart())
        done = wire.Done(rid, "ok", "length", wire.Usage(1, 1), wire.Timings(0, 0, 0))
        workers[name].send_multipart(wire.encode_from_worker(done, assign.ticket))
        assert broker.back.poll(1000)
        broker.drain_back()
        assert client.poll(1000)
        client.recv_multipart()
        return name

    with peers(broker, slots=1) as (client, workers):
        remote = b"pool-b-99-w0"  # a remote pool's worker (HOST-PID-wN), with its host's store
        workers[remote] = broker.front.context.socket(zmq.DEALER)
        workers[remote].setsockopt(zmq.IDENTITY, remote)
        workers[remote].connect("inproc://back")
        register(workers, remote, 99, held, host="pool-b")
        assert broker.tables.workers[remote].ram and not broker.tables.workers[b"w0"].ram  # that host's, not this one's
        assert routed(client, workers, "r1") == remote and broker.tables.stats["routed_ram_prefix"] == 1


def test_a_steps_chunks_reach_a_client_before_its_done_and_the_later_ones_after(broker: Broker) -> None:
    ctx = broker.front.context
    client, worker = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    worker.setsockopt(zmq.IDENTITY, b"w0")
    worker.connect("inproc://back")
    client.connect("inproc://front")
    broker.registry.register(b"w0", wire.Ready("w0", "m", -1, 2, 1, proof=broker.link_secret), None)
    try:
        for rid in ("a1", "a2"):
            client.send_multipart(wire.encode(wire.Request(rid, "hi", stream=True)))
        while len(broker.tables.requests) < 2:
            assert broker.front.poll(1000)
            broker.drain_front()
        tickets = {a.request.id: a.ticket for a in assigns(worker, 2)}
        done = wire.Done("a1", "x", "length", wire.Usage(1, 1), wire.Timings(0, 0, 0))
        worker.send_multipart(wire.encode_step([
            (wire.MsgType.CHUNK, tickets["a1"], wire.pack(wire.Chunk("a1", "x")), None),
            (wire.MsgType.CHUNK, tickets["a2"], wire.pack(wire.Chunk("a2", "z")), None),
            (wire.MsgType.DONE, tickets["a1"], wire.pack(done), None),
            (wire.MsgType.CHUNK, tickets["a2"], wire.pack(wire.Chunk("a2", "w")), None),
        ]))
        assert broker.back.poll(1000)
        broker.drain_back()
        got = []
        while client.poll(200):
            got.append(wire.decode(client.recv_multipart()))
        assert got == [wire.Chunks((wire.Chunk("a1", "x"), wire.Chunk("a2", "z"))), done, wire.Chunk("a2", "w")]
        assert tickets["a1"] not in broker.tables.requests and broker.tables.stats["done"] == 1
    finally:
        client.close(0)
        worker.close(0)


def test_the_assigns_of_one_drain_go_to_a_worker_as_one_message_and_a_cancel_after_them(broker: Broker) -> None:
    with peers(broker, slots=4) as (client, workers):
        for rid in ("r1", "r2", "r3", "r4"):
            client.send_multipart(wire.encode(wire.Request(rid, "hi")))
        client.send_multipart(wire.encode(wire.Cancel("r4")))
        while broker.tables.stats[ErrorCode.CANCELLED] == 0:
            assert broker.front.poll(1000)
            broker.drain_front()
        messages: dict[bytes, list[Any]] = {name: [] for name in workers}
        for name, sock in workers.items():
            while sock.poll(200):
                messages[name].append(wire.decode(sock.recv_multipart()))
        # the least busy instance takes each: r1, r3 on one, r2, r4 on the other, each pair as one message
        sent = sorted(messages.values(), key=len)
        kinds = [[type(m).__name__ for m in ms] for ms in sent]
        assert kinds == [["Assigns"], ["Assigns", "Cancel"]], kinds
        assert [len(ms[0].assigns) for ms in sent] == [2, 2]
        cancelled = sent[1][1]
        assert cancelled.id in {a.ticket for a in sent[1][0].assigns}


def test_a_worker_of_another_worker_protocol_is_refused_with_both_versions_named(broker: Broker) -> None:
    worker = broker.front.context.socket(zmq.DEALER)
    worker.setsockopt(zmq.IDENTITY, b"w7")
    worker.connect("inproc://back")
    try:
        worker.send_multipart(wire.encode_from_worker(wire.Ready("w7", "m", -1, 2, 1, host="old", protocol="MPS1")))
        assert broker.back.poll(1000)
        broker.drain_back()
        assert worker.poll(1000)
        refusal = wire.decode(worker.recv_multipart())
        assert isinstance(refusal, wire.Error) and refusal.code == "protocol"
        assert f"{wire.WORKER_LINK}, not MPS1:" in refusal.message
        assert b"w7" not in broker.tables.workers and broker.tables.models["m"].instances == 0
    finally:
        worker.close(0)


def test_a_worker_that_leaves_is_forgotten_at_once_and_its_request_resumed_with_the_whole_requests_timings(
        broker: Broker) -> None:
    """LEAVING (a pool stopping, or gone): the worker is dropped without waiting for its silence, its streamed
    request goes on elsewhere, and the DONE's timings are those of the whole request as the client saw it, not
    of the last worker's part."""
    with peers(broker, slots=1) as (client, workers):
        t_asked = time.monotonic()
        ask(broker, client, "r1")
        [(first, assign)] = taken(workers).values()
        time.sleep(0.05)  # not a wait: queue and prompt, the time before the first token
        workers[first].send_multipart(wire.encode_from_worker(wire.Chunk("r1", "ab"), assign.ticket,
                                                              wire.token_frame([7, 8])))
        assert broker.back.poll(1000)
        broker.drain_back()
        assert answer(client) == wire.Chunk("r1", "ab")
        t_first = time.monotonic()
        time.sleep(0.2)  # not a wait: generating, then the worker leaves
        workers[first].send_multipart(wire.encode_from_worker(wire.Leaving(first.decode(), "it got SIGTERM")))
        assert broker.back.poll(1000)
        broker.drain_back()
        assert first not in broker.tables.workers and broker.tables.stats["worker_left"] == 1
        [(second, resumed)] = taken(workers).values()
        assert second != first and resumed.attempt == 2 and wire.frame_tokens(resumed.generated) == [7, 8]
        time.sleep(0.1)  # not a wait: the second instance's part of the time
        done = wire.Done("r1", "abcd", "length", wire.Usage(1, 4), wire.Timings(400.0, 2.0, 1.0, attempts=2))
        workers[second].send_multipart(wire.encode_from_worker(done, resumed.ticket))
        assert broker.back.poll(1000)
        broker.drain_back()
        got = answer(client)
        t_done = time.monotonic()
        assert isinstance(got, wire.Done) and got.text == "abcd" and got.timings.attempts == 2
        t = got.timings
        assert t.queue_ms + t.prompt_ms <= (t_first - t_asked) * 1000  # not the first worker's run as queueing
        assert t.prompt_ms >= 50 and t.generate_ms >= 300  # across the hand-over, not the last worker's 1 ms
        assert t.queue_ms + t.prompt_ms + t.generate_ms <= (t_done - t_asked) * 1000


def test_a_leaving_worker_the_broker_does_not_know_is_not_asked_to_register(broker: Broker) -> None:
    with peers(broker, slots=1) as (_, workers):
        broker.worker_exited(0, -signal.SIGKILL)
        workers[b"w0"].send_multipart(wire.encode_from_worker(wire.Leaving("w0", "told to stop")))
        assert broker.back.poll(1000)
        broker.drain_back()
        assert not workers[b"w0"].poll(100) and broker.tables.stats["worker_left"] == 0


# --- how a worker ended: a crash, a kill, a model whose workers crash ------------------------------

def ask(broker: Broker, client: zmq.Socket[bytes], rid: str) -> None:
    """Send the request ``rid`` and let the broker take it."""
    client.send_multipart(wire.encode(wire.Request(rid, "hi", stream=True)))
    accepted = broker.tables.stats["accepted"]
    while broker.tables.stats["accepted"] == accepted:
        assert broker.front.poll(1000)
        broker.drain_front()


def taken(workers: dict[bytes, zmq.Socket[bytes]]) -> dict[str, tuple[bytes, wire.Assign]]:
    """The assignments the fake workers got since the last look: request id -> (worker, assignment)."""
    got = {}
    for name, sock in workers.items():
        while sock.poll(50):
            msg = wire.decode(sock.recv_multipart())
            got.update({a.request.id: (name, a) for a in (msg.assigns if isinstance(msg, wire.Assigns) else [msg])})
    return got


def ends(broker: Broker, name: bytes, code: int, slots: int = 1) -> None:
    """Worker ``name`` exits with ``code``, and its replacement (a new process) registers."""
    broker.worker_exited(int(name[1:]), code)
    broker.registry.register(name, wire.Ready(name.decode(), "m", -1, slots, 2, proof=broker.link_secret), None)
    broker.flush()


def answer(client: zmq.Socket[bytes]) -> Any:
    assert client.poll(1000), "no answer"
    return wire.decode(client.recv_multipart())


def test_a_worker_killed_from_outside_hands_its_request_over_up_to_the_bound_named_in_the_error(broker: Broker) -> None:
    with peers(broker, slots=1) as (client, workers):
        ask(broker, client, "r1")
        for lost in range(1, MAX_HANDOVERS + 1):
            name, assign = taken(workers)["r1"]
            assert assign.attempt == lost
            ends(broker, name, -(signal.SIGKILL if lost % 2 else signal.SIGTERM))
            assert broker.tables.stats["worker_crashed"] == 0 and not broker.tables.stats[ErrorCode.POISON_REQUEST]
            if lost < MAX_HANDOVERS:
                assert not client.poll(0), f"answered after {lost} hand-overs"
        error = answer(client)
        assert isinstance(error, wire.Error) and error.code == ErrorCode.WORKER_LOST
        assert f"lost {MAX_HANDOVERS} workers" in error.message and f"bound on hand-overs ({MAX_HANDOVERS})" in (
            error.message), error.message
        assert "signal SIGTERM" in error.message and not broker.tables.requests


def test_a_request_that_crashes_or_stalls_two_workers_is_poison_and_its_model_serves_on(broker: Broker) -> None:
    with peers(broker, slots=1) as (client, workers):
        ask(broker, client, "r1")
        ends(broker, taken(workers)["r1"][0], -signal.SIGSEGV)
        name, assign = taken(workers)["r1"]
        assert assign.attempt == 2 and not client.poll(0)
        broker.worker_stalled(int(name[1:]), 30.0)  # a stall counts as a crash of the request
        error = answer(client)
        assert isinstance(error, wire.Error) and error.code == ErrorCode.POISON_REQUEST, error
        assert "2 workers that crashed or stalled" in error.message
        assert broker.tables.models["m"].failed is None and broker.tables.models["m"].crash_streak == 1  # one request
        ask(broker, client, "r2")
        assert list(taken(workers)) == ["r2"]


def test_a_model_whose_workers_crash_on_different_requests_in_a_row_fails_naming_the_signal(broker: Broker) -> None:
    """One worker of two slots, replaced after each crash. r1 crashes alone; then with r2, new to the streak: r1
    is poison; then r2 (its second crash) with r3, new: the model's third such crash fails the model, which
    answers r2 (not poison), r3 and the queued r4, and refuses r5."""
    worker = broker.front.context.socket(zmq.DEALER)
    worker.setsockopt(zmq.IDENTITY, b"w0")
    worker.connect("inproc://back")
    client = broker.front.context.socket(zmq.DEALER)
    client.connect("inproc://front")
    broker.registry.register(b"w0", wire.Ready("w0", "m", -1, 2, 1, proof=broker.link_secret), None)
    try:
        ask(broker, client, "r1")
        assigns(worker, 1)
        ends(broker, b"w0", -signal.SIGILL, slots=2)
        ask(broker, client, "r2")
        assert {a.request.id for a in assigns(worker, 2)} == {"r1", "r2"}
        ends(broker, b"w0", -signal.SIGILL, slots=2)
        poison = answer(client)
        assert (poison.id, poison.code) == ("r1", ErrorCode.POISON_REQUEST)
        ask(broker, client, "r3")
        assert {a.request.id for a in assigns(worker, 2)} == {"r2", "r3"}
        ask(broker, client, "r4")  # queued: both slots are busy
        assert broker.tables.models["m"].crash_streak == MODEL_CRASHES - 1 and not client.poll(0)
        ends(broker, b"w0", -signal.SIGSEGV, slots=2)
        failed = [answer(client) for _ in range(3)]
        assert sorted((e.id, e.code) for e in failed) == [(r, ErrorCode.MODEL_FAILED) for r in ("r2", "r3", "r4")]
        assert all(e.message == failed[0].message for e in failed)
        assert "model m crashed its workers with SIGSEGV" in failed[0].message
        assert "repack: false (--no-repack" in failed[0].message and "n_gpu_layers" in failed[0].message
        assert not broker.tables.requests and broker.snapshot().models["m"].failed is not None
        client.send_multipart(wire.encode(wire.Request("r5", "hi")))
        assert broker.front.poll(1000)
        broker.drain_front()
        refused = answer(client)
        assert (refused.id, refused.code, refused.message) == ("r5", ErrorCode.MODEL_FAILED, failed[0].message)
        assert not worker.poll(0)
    finally:
        client.close(0)
        worker.close(0)


def test_a_done_between_crashes_starts_the_models_count_afresh(broker: Broker) -> None:
    """r1 and r2 crash a worker each; r1 is done on its next; r3 crashing then is the first crash of a new
    count (without the DONE it would be the third, and fail the model)."""
    with peers(broker, slots=1) as (client, workers):
        ask(broker, client, "r1")
        ends(broker, taken(workers)["r1"][0], -signal.SIGSEGV)
        ask(broker, client, "r2")
        running = taken(workers)
        ends(broker, running["r2"][0], -signal.SIGSEGV)
        assert broker.tables.models["m"].crash_streak == 2 and list(taken(workers)) == ["r2"]
        name, assign = running["r1"]
        done = wire.Done("r1", "ok", "length", wire.Usage(1, 1), wire.Timings(0, 0, 0))
        workers[name].send_multipart(wire.encode_from_worker(done, assign.ticket))
        assert broker.back.poll(1000)
        broker.drain_back()
        got = answer(client)  # its timings are the whole request's: it was handed over (``test_...timings...``)
        assert msgspec.structs.replace(got, timings=done.timings) == done
        assert broker.tables.models["m"].crash_streak == 0
        ask(broker, client, "r3")
        ends(broker, taken(workers)["r3"][0], -signal.SIGSEGV)
        assert broker.tables.models["m"].failed is None and broker.tables.models["m"].crash_streak == 1


def test_a_remote_worker_that_cannot_be_reached_is_said_so_once_in_words_that_fit_it(
        broker: Broker, caplog: pytest.LogCaptureFixture) -> None:
    """No supervisor owns a remote worker: its silence decides; the failed sends are logged once, not every
    heartbeat, until it is heard from again."""
    ctx = broker.front.context
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"far-w0")
    sock.connect("inproc://back")
    broker.registry.register(b"far-w0", wire.Ready("far-w0", "m", -1, 1, 7, host="elsewhere"), None)
    sock.close(0)  # its link is down
    time.sleep(0.1)  # not a wait: inproc's disconnect reaches the ROUTER unseen by any call
    with caplog.at_level("WARNING", logger="mpserve.broker"):
        for _ in range(3):
            broker.send_heartbeats()
    [said] = [r.getMessage() for r in caplog.records if "cannot send" in r.getMessage()]
    assert "far-w0 on elsewhere" in said and "declared lost if it stays silent for 5.0 s" in said
    assert "supervisor" not in said


def test_a_remote_workers_ready_that_cannot_be_answered_registers_nothing(
        broker: Broker, caplog: pytest.LogCaptureFixture) -> None:
    """A READY that came over a connection the broker can no longer send on (here: none) would register a worker
    every request sent to it is lost to; unanswered, the worker connects and registers again by itself."""
    with caplog.at_level("WARNING", logger="mpserve.broker"):
        broker.registry.register(b"far-w0", wire.Ready("far-w0", "m", -1, 1, 7, host="elsewhere"), None)
    tables = broker.tables
    assert not tables.workers and not tables.models["m"].free and tables.stats["unanswered_ready"] == 1
    assert [r.getMessage() for r in caplog.records] == [
        "worker far-w0 on elsewhere: its READY came over a connection that is closing; not registered until it "
        "registers again"]


def test_a_request_not_sent_to_a_remote_worker_goes_elsewhere_even_if_that_worker_talks_again(
        broker: Broker) -> None:
    """An ASSIGN that could not be sent (the link was down) never reached the worker; one that reconnects and
    talks again under its name would hold that request unanswered for good: it is declared lost at once."""
    ctx = broker.front.context
    client, far, near = (ctx.socket(zmq.DEALER) for _ in range(3))
    try:
        client.connect("inproc://front")
        far.setsockopt(zmq.IDENTITY, b"far-w0")
        far.connect("inproc://back")
        broker.registry.register(b"far-w0", wire.Ready("far-w0", "m", -1, 1, 7, host="elsewhere"), None)
        far.close(0)  # its link is down
        time.sleep(0.1)  # not a wait: inproc's disconnect reaches the ROUTER unseen by any call
        ask(broker, client, "r1")  # assigned to far-w0, the only worker: the send fails
        broker.flush()
        # the same process heard from again (on a new link: what the ROUTER hands over, as it receives it)
        broker.registry.message([b"far-w0", *wire.encode_from_worker(wire.Heartbeat("far-w0"))])
        assert not broker.tables.workers[b"far-w0"].unreachable
        near.setsockopt(zmq.IDENTITY, b"near-w0")
        near.connect("inproc://back")
        near.send_multipart(wire.encode_from_worker(wire.Ready("near-w0", "m", -1, 1, 8, host="nearby")))
        assert broker.back.poll(1000)
        broker.drain_back()  # registered, over its link
        assert isinstance(wire.decode(near.recv_multipart()), wire.Heartbeat)  # answered at once
        broker.expire_workers(time.monotonic())
        assert taken({b"near-w0": near})["r1"][1].attempt == 2  # handed over
        assert b"far-w0" not in broker.tables.workers and broker.tables.stats["worker_link_down"] == 1
        assert not broker.tables.stats["worker_expired"]
    finally:
        for sock in (client, far, near):
            sock.close(0)


def test_a_request_waits_for_a_loading_instance_and_otherwise_ends_no_instance_after_the_bound() -> None:
    ctx = zmq.Context()
    hooks = Loading()
    broker = Broker(ctx, "inproc://front-unserved", "inproc://back-unserved", {"m": 8}, no_instance_timeout=3.0,
                    hooks=hooks)
    client = ctx.socket(zmq.DEALER)
    client.connect("inproc://front-unserved")
    try:
        hooks.starting = True
        client.send_multipart(wire.encode(wire.Request("r1", "hi", timeout=5.0)))
        assert broker.front.poll(1000)
        broker.drain_front()
        now = time.monotonic()
        broker.expire_unserved(now + 60)  # an instance loads: the request waits for it, past the bound
        assert not client.poll(50)
        broker.expire(now + 5)  # its own timeout: the model is still loading
        error = answer(client)
        assert (error.id, error.code) == ("r1", ErrorCode.NO_INSTANCE) and "still loading" in error.message

        hooks.starting = False
        client.send_multipart(wire.encode(wire.Request("r2", "hi")))
        assert broker.front.poll(1000)
        broker.drain_front()
        now = time.monotonic()
        broker.expire_unserved(now)  # unserved from now
        broker.expire_unserved(now + 2.9)
        assert not client.poll(50)
        broker.expire_unserved(now + 3.0)
        error = answer(client)
        assert (error.id, error.code) == ("r2", ErrorCode.NO_INSTANCE) and "has registered" in error.message
        assert not broker.tables.requests and not broker.tables.models["m"].queue
    finally:
        client.close(0)
        broker.close()
        ctx.term()


def test_a_lookup_is_answered_only_by_the_worker_it_was_sent_to(broker: Broker) -> None:
    with peers(broker, slots=1) as (client, workers):
        client.send_multipart(wire.encode(wire.Tokenize("t1", "m", "hi")))
        assert broker.front.poll(1000)
        broker.drain_front()
        asked = next(name for name, sock in workers.items() if sock.poll(1000))
        ticket = wire.decode(workers[asked].recv_multipart()).ticket
        other = next(name for name in workers if name != asked)
        forged = wire.encode_from_worker(wire.Tokens("t1", wire.pack_tokens([6])), ticket)
        workers[other].send_multipart(forged)  # the right ticket, from another worker
        assert broker.back.poll(1000)
        broker.drain_back()
        assert not client.poll(100) and broker.tables.stats["dropped_foreign_lookup_answer"] == 1
        workers[asked].send_multipart(wire.encode_from_worker(wire.Tokens("t1", wire.pack_tokens([1, 2])), ticket))
        assert broker.back.poll(1000)
        broker.drain_back()
        answer = wire.decode(client.recv_multipart()) if client.poll(1000) else None
        assert isinstance(answer, wire.Tokens) and wire.unpack_tokens(answer.tokens) == [1, 2]
        assert not broker.tables.lookups


def test_tickets_are_random_and_a_worker_registers_only_under_its_connections_name(broker: Broker) -> None:
    with peers(broker, slots=2) as (client, workers):
        for i in range(4):
            client.send_multipart(wire.encode(wire.Request(f"r{i}", "hi")))
        assert broker.front.poll(1000)
        broker.drain_front()
        tickets = [a.ticket for sock in workers.values() for a in assigns(sock, 2)]
    assert len(set(tickets)) == 4 and all(len(t) >= 22 for t in tickets)  # 128 random bits each
    broker.registry.register(b"pool-1-w0", wire.Ready("pool-1-w1", "m", -1, 1, 1, host="pool"), None)
    assert b"pool-1-w0" not in broker.tables.workers and broker.tables.stats["refused_worker_ready"] == 1


def test_a_requests_salt_goes_with_its_assign_and_a_slots_last_prompt_draws_only_the_same_salt(broker: Broker) -> None:
    """The broker salts each request (``mpserve.wire.salt``: tenant, or cache_salt in its stead), sends the salt
    in its ASSIGN for the worker's reuse, and routes by a slot's last prompt only under the same salt."""
    prompt = "A memo that runs long enough to route by: the offer closes on 12 March at 41 dollars per share."

    def routed(client: zmq.Socket[bytes], workers: dict[bytes, zmq.Socket[bytes]], rid: str,
               **fields: Any) -> tuple[bytes, wire.Assign]:
        admin.send_multipart(wire.encode(wire.Request(rid, prompt, **fields)))  # where a tenant may be named
        assert broker.admin is not None and broker.admin.poll(1000)
        broker.drain_admin()
        name = next(name for name, sock in workers.items() if sock.poll(1000))
        assign = assigns(workers[name], 1)[0]
        done = wire.Done(rid, "ok", "length", wire.Usage(1, 1), wire.Timings(0, 0, 0))
        workers[name].send_multipart(wire.encode_from_worker(done, assign.ticket))
        assert broker.back.poll(1000)
        broker.drain_back()
        answer(admin)
        return name, assign

    a, b = "key:" + "a" * 16, "key:" + "b" * 16
    admin = broker.front.context.socket(zmq.DEALER)
    admin.connect("inproc://admin")
    with peers(broker, slots=1) as (client, workers), contextlib.closing(admin):
        first, assign = routed(client, workers, "r1", tenant=a)
        assert assign.salt == reuse_salt(a, None, ()) != b""
        other, assign = routed(client, workers, "r2", tenant=b)
        assert assign.salt == reuse_salt(b, None, ()) and other != first  # A's slot draws nothing of B's
        assert broker.tables.stats["routed_kv_prefix"] == 0
        again, assign = routed(client, workers, "r3", tenant=a)
        assert again == first and broker.tables.stats["routed_kv_prefix"] == 1  # A's own prompt, in A's slot
        shared, assign = routed(client, workers, "r4", tenant=b, cache_salt="public")
        assert assign.salt == reuse_salt(a, "public", ())
        assert routed(client, workers, "r5", tenant=a, cache_salt="public")[0] == shared  # one salt: shared
        assert broker.tables.stats["routed_kv_prefix"] == 2
        assert routed(client, workers, "r6")[1].salt == b""  # the default tenant: as before
def test_requests_of_one_adapter_set_go_to_the_instance_running_that_set(broker: Broker) -> None:
    broker.tables.models["m"].adapters = Served(["fr", "de"])
    with peers(broker, slots=4) as (client, workers):
        for entry in broker.tables.workers.values():
            entry.adapters = frozenset({"fr", "de"})
        def send(rid: str, adapters: tuple[tuple[str, float], ...]) -> bytes:
            client.send_multipart(wire.encode(wire.Request(rid, "hi", adapters=adapters)))
            assert broker.front.poll(1000)
            broker.drain_front()
            chosen = next(name for name, sock in workers.items() if sock.poll(200))
            assert assigns(workers[chosen], 1)[0].request.adapters == adapters
            return chosen

        fr = send("f1", (("fr", 1.0),))
        de = send("d1", (("de", 1.0),))  # the other instance is idle: it takes the other set
        assert {fr, de} == {b"w0", b"w1"}
        assert send("f2", (("fr", 1.0),)) == fr and send("f3", (("fr", 1.0),)) == fr  # batches with its set, though
        assert send("d2", (("de", 1.0),)) == de  # the other instance is less busy
        client.send_multipart(wire.encode(wire.Request("x", "hi", adapters=(("es", 1.0),))))
        assert broker.front.poll(1000)
        broker.drain_front()
        error = wire.decode(client.recv_multipart())
        assert error.code == "unknown_adapter" and "served adapters: m:fr (id 0), m:de (id 1)" in error.message


def test_a_freed_slot_takes_a_younger_request_of_its_instance_s_set_before_an_older_of_another(
        broker: Broker) -> None:
    broker.tables.models["m"].adapters = Served(["fr", "de", "es"])
    with peers(broker, slots=2) as (client, workers):
        for entry in broker.tables.workers.values():
            entry.adapters = frozenset({"fr", "de", "es"})
        placed: dict[str, tuple[bytes, str]] = {}  # request id -> its worker and ticket

        def send(rid: str, name: str) -> None:
            client.send_multipart(wire.encode(wire.Request(rid, "hi", adapters=((name, 1.0),))))
            assert broker.front.poll(1000)
            broker.drain_front()
            for identity, sock in workers.items():
                while sock.poll(50):
                    for a in assigns(sock, 1):
                        placed[a.request.id] = (identity, a.ticket)

        for rid, name in (("f1", "fr"), ("d1", "de"), ("f2", "fr"), ("d2", "de"), ("e1", "es"), ("f3", "fr")):
            send(rid, name)
        assert {rid: w for rid, (w, _) in placed.items()} == {"f1": placed["f1"][0], "f2": placed["f1"][0],
                                                              "d1": placed["d1"][0], "d2": placed["d1"][0]}
        fr_worker, ticket = placed["f1"]
        workers[fr_worker].send_multipart(wire.encode_from_worker(
            wire.Done("f1", "x", "length", wire.Usage(1, 1), wire.Timings(0, 0, 0)), ticket))
        assert broker.back.poll(1000)
        broker.drain_back()
        assert workers[fr_worker].poll(1000)
        assert [a.request.id for a in assigns(workers[fr_worker], 1)] == ["f3"]  # batches with f2; e1 waits
        assert broker.tables.requests[broker.tables.models["m"].queue.oldest()].request.id == "e1"
