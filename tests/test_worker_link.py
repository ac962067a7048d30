"""The worker link cannot be impersonated: a process that dials the worker socket under a local worker's name
without the start's secret takes none of its requests, and its READY is refused; a worker's malformed or
mismatched DONE or CHUNK ends that request at once; a seeded fuzz of 10,000 worker messages ends with every
request answered exactly once. Real server, raw ZeroMQ sockets on both sides.
"""

from __future__ import annotations

import collections
import contextlib
import random
import time
from typing import Any

import msgpack
import pytest
import zmq
from conftest import ServerProcess
from helpers import dealer, wait_for

from mpserve import Client
from mpserve.wire import protocol as wire

SEED = 20261203
FUZZ_MESSAGES = 10_000
REQUEST_TIMEOUT_S = 20.0  # the backstop; a request the fuzz broke must end long before it


def ready(sock: zmq.Socket[bytes], name: str, capacity: int = 2, host: str = "") -> None:
    sock.send_multipart(wire.encode_from_worker(wire.Ready(name, "echo", -1, capacity, 4242, host=host)))


def assignments(frames: list[bytes]) -> list[wire.Assign]:
    msg = wire.decode(frames)
    return list(msg.assigns) if isinstance(msg, wire.Assigns) else [msg] if isinstance(msg, wire.Assign) else []


def request(rid: str, prompt: str = "hello") -> list[bytes]:
    return wire.encode(wire.Request(rid, prompt, params=wire.GenerateParams(max_tokens=4), stream=True,
                                    timeout=REQUEST_TIMEOUT_S))


@pytest.fixture(scope="module")
def echo_server() -> Any:
    server = ServerProcess("--model", "echo", "--instances", "1", "--parallel", "2", "--heartbeat-interval", "0.2",
                           "--max-pending-per-client", "4096").wait_ready()
    yield server
    server.stop()


@pytest.mark.timeout(60)
def test_an_impostor_under_w0_takes_none_of_w0s_requests_and_its_ready_is_refused(echo_server: ServerProcess) -> None:
    # w0 is connected: the impostor's link gets nothing; no worker holds w7, but it is a local name
    with dealer(echo_server.info.back, b"w0") as impostor, dealer(echo_server.info.back, b"w7") as free_name:
        ready(impostor, "w0")
        ready(free_name, "w7")
        with Client(echo_server.address, timeout=30) as client:
            results = [client.generate(f"mine {i}", max_tokens=4) for i in range(6)]
            assert all(r.worker == "w0" and r.text for r in results)
            refusal = wire.decode(free_name.recv_multipart()) if free_name.poll(3000) else None
            assert isinstance(refusal, wire.Error) and "does not prove it is one of them" in refusal.message
            assert not impostor.poll(200), "the impostor got a message meant for w0"
            stats = client.stats()
        assert stats.counters["refused_worker_ready"] >= 1
        assert [w.worker for w in stats.workers] == ["w0"]  # neither registered


@pytest.mark.timeout(60)
def test_a_done_for_another_id_ends_its_request_at_once_with_an_error(echo_server: ServerProcess) -> None:
    # a remote pool's worker that answers wrong
    with dealer(echo_server.info.back, b"bad-1-w0") as worker, dealer(echo_server.address) as client:
        ready(worker, "bad-1-w0", capacity=64, host="bad")
        wait_for(lambda: any(w.worker == "bad-1-w0" for w in Client(echo_server.address).stats().workers), 10,
                 "the remote worker registered")
        ends: dict[str, tuple[str, float]] = {}
        sent = time.monotonic()
        for i in range(8):
            client.send_multipart(request(f"r{i}"))
        answered = 0
        deadline = time.monotonic() + 10
        while len(ends) < 8 and time.monotonic() < deadline:
            if worker.poll(10):
                for a in assignments(worker.recv_multipart()):
                    body = wire.Done("someone-else", "x", "stop", wire.Usage(), wire.Timings())
                    worker.send_multipart(wire.encode_from_worker(body, a.ticket))
                    answered += 1
            while client.poll(0):
                msg = wire.decode(client.recv_multipart())
                if isinstance(msg, (wire.Done, wire.Error)):
                    ends[str(msg.id)] = (msg.code if isinstance(msg, wire.Error) else "done", time.monotonic() - sent)
        assert answered >= 1  # some went to w0 (the real echo instance), some to the bad worker
        assert len(ends) == 8 and max(t for _, t in ends.values()) < REQUEST_TIMEOUT_S / 2
        codes = collections.Counter(code for code, _ in ends.values())
        assert codes["internal"] == answered and codes["done"] == 8 - answered, codes


# --- the worker-side fuzz -------------------------------------------------------------------------------

def fuzz_answer(rng: random.Random, a: wire.Assign, families: collections.Counter[str]) -> list[list[bytes]]:
    """What a broken or hostile worker sends for assignment ``a``: sometimes right, mostly wrong."""
    rid, ticket = a.request.id, a.ticket
    done = wire.Done(rid, "ok", "stop", wire.Usage(1, 1), wire.Timings(), worker="fz")
    kind = rng.choices(["done", "chunk_done", "error", "wrong_id", "wrong_chunk", "garbage_done", "garbage_chunk",
                        "wrong_ticket", "step_garbage", "bad_frames", "bad_ready"], [1] * 10 + [0.05])[0]
    families[kind] += 1
    if kind == "done":
        return [wire.encode_from_worker(done, ticket)]
    if kind == "chunk_done":
        return [wire.encode_from_worker(wire.Chunk(rid, "o"), ticket, b"\x01\x00\x00\x00"),
                wire.encode_from_worker(done, ticket)]
    if kind == "error":
        return [wire.encode_from_worker(wire.Error(rid, "internal", "fuzz"), ticket)]
    if kind == "wrong_id":
        return [wire.encode_from_worker(wire.Done(rid + "x", "no", "stop", wire.Usage(), wire.Timings()), ticket)]
    if kind == "wrong_chunk":
        return [wire.encode_from_worker(wire.Chunk("other", "no"), ticket)]
    if kind == "garbage_done":
        body = rng.choice([rng.randbytes(rng.randint(0, 40)), msgpack.packb({"id": rid}),
                           msgpack.packb([rid]), msgpack.packb({"id": rid, "usage": "x"})])
        return [wire.worker_frames(wire.MsgType.DONE, ticket, body)]
    if kind == "garbage_chunk":
        body = rng.choice([rng.randbytes(rng.randint(0, 40)), msgpack.packb({"id": 7}), msgpack.packb(None)])
        return [wire.worker_frames(wire.MsgType.CHUNK, ticket, body)]
    right = wire.encode_from_worker(done, ticket)
    if kind == "wrong_ticket":  # a stale or invented ticket: dropped; then the right answer
        return [wire.encode_from_worker(done, format(rng.randint(1, 1 << 20), "x")), right]
    if kind == "step_garbage":
        return [wire.worker_frames(wire.MsgType.STEP, "", rng.choice([b"\x91\x01", rng.randbytes(12),
                                                                       msgpack.packb([[1, ticket, b"x", None]])])),
                right]
    if kind == "bad_frames":
        return [[rng.randbytes(rng.randint(0, 6)) for _ in range(rng.randint(1, 6))], right]
    # a READY under the same name from another process: the broker takes the worker as restarted and hands its
    # requests over (to w0, or back to it)
    return [wire.encode_from_worker(wire.Ready("fz-1-w0", "echo", -1, 32, rng.randint(1, 1 << 20), host="fuzz"))]


@pytest.mark.timeout(240)
def test_ten_thousand_worker_messages_end_every_request_exactly_once(echo_server: ServerProcess) -> None:
    rng = random.Random(SEED)
    stack = contextlib.ExitStack()
    worker = stack.enter_context(dealer(echo_server.info.back, b"fz-1-w0"))
    client = stack.enter_context(dealer(echo_server.address))
    ends: collections.Counter[str] = collections.Counter()
    codes: collections.Counter[str] = collections.Counter()
    families: collections.Counter[str] = collections.Counter()

    def take_client() -> None:
        while client.poll(0):
            msg = wire.decode(client.recv_multipart())
            if isinstance(msg, (wire.Done, wire.Error)):
                ends[str(msg.id)] += 1
                codes[msg.code if isinstance(msg, wire.Error) else "done"] += 1

    with stack:
        ready(worker, "fz-1-w0", capacity=32, host="fuzz")
        sent, asked, last_beat = 0, 0, 0.0
        while sent < FUZZ_MESSAGES:
            while asked - sum(ends.values()) < 256:
                client.send_multipart(request(f"q{asked}"))
                asked += 1
            if time.monotonic() - last_beat > 0.1:  # stay alive, so the fuzz answers are what is judged
                worker.send_multipart(wire.encode_from_worker(wire.Heartbeat("fz-1-w0")))
                client.send_multipart(wire.encode(wire.Ping(0)))
                last_beat = time.monotonic()
            worker.poll(2)
            while worker.poll(0):
                frames = worker.recv_multipart()
                cancel = wire.decode(frames)
                if isinstance(cancel, wire.Cancel):  # as a worker does: the cancelled request's slot frees
                    worker.send_multipart(wire.encode_from_worker(wire.Error("", "cancelled", "c"), cancel.id))
                for a in assignments(frames):
                    for frames in fuzz_answer(rng, a, families):
                        worker.send_multipart(frames)
                        sent += 1
            take_client()
        worker.close()  # silent from now: the broker declares it lost and hands its requests to w0
        deadline = time.monotonic() + REQUEST_TIMEOUT_S + 10
        while len(ends) < asked and time.monotonic() < deadline:
            client.send_multipart(wire.encode(wire.Ping(0)))
            client.poll(100)
            take_client()
        time.sleep(0.3)  # not a wait: a second answer, if any, would come now
        take_client()
        print(f"\nworker fuzz: {sent} messages (seed {SEED}), kinds {dict(families)}; {asked} requests, "
              f"ends {dict(codes)}")
        assert len(ends) == asked, f"{asked - len(ends)} request(s) never answered"
        assert set(ends.values()) == {1}, "a request answered twice"
        assert codes["internal"] > codes["worker_lost"] and codes["done"] > 0
        with Client(echo_server.address, timeout=30) as after:
            stats = after.stats()
            assert after.generate("after the storm", max_tokens=4).text
        assert stats.counters["worker_malformed_result"] > 0
        assert echo_server.proc.poll() is None and not echo_server.tracebacks(), "\n".join(echo_server.log)
