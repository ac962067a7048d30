"""Fuzzing the broker's front socket with a raw DEALER: random and mutated multipart messages must never
crash the server, leak memory or stop it serving; a message over the size limit costs its sender the
connection and nothing else. The generator is seeded: a failure reproduces with the same seed.
"""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq
import zmq.utils.monitor
from helpers import MALLOC_ENV, rss_kib

from mpserve import Client
from mpserve.errors import MpserveError
from mpserve.wire import protocol as wire

SEED = 20240504
WARMUP_MESSAGES = 5_000
FUZZ_MESSAGES = 10_000
RSS_GROWTH_LIMIT = 0.10
SIZE_LIMIT = wire.MAX_MESSAGE_BYTES + 4096  # the front socket's ZMQ_MAXMSGSIZE
IDS = [f"f{i}" for i in range(40)]  # a small id space, so duplicates and cancels meet pending requests

Frames = list[bytes]
CLIENT_SENT = {t for t in wire.MsgType if t.name in ("REQUEST", "CANCEL", "PING", "STATS_QUERY", "TOKENIZE",
                                                  "EMBED")}
CLIENT_BOUND = {t for t in wire.MsgType if t.name in ("CHUNK", "CHUNKS", "DONE", "ERROR", "PONG", "STATS", "TOKENS",
                                                  "EMBEDDINGS")}


# --- the generator ------------------------------------------------------------------------------

def _type(t: wire.MsgType) -> bytes:
    return bytes([t])


def _valid_request(rng: random.Random) -> dict[str, Any]:
    """A request that is valid and cheap (a few tokens, a short timeout), as a map to mutate."""
    body: dict[str, Any] = {"id": rng.choice(IDS), "prompt": rng.choice(["hi", "Hello world", "1 2 3", ""]),
                            "params": {"max_tokens": rng.randint(1, 8), "temperature": rng.choice([0, 0.7])},
                            "timeout": 2.0}
    if rng.random() < 0.5:
        body["stream"] = True
    if rng.random() < 0.3:
        body["params"]["stop"] = ["\n"]
    if rng.random() < 0.2:
        body["model"] = "tiny"
    if rng.random() < 0.2:  # choices: 2 run together in the instance's 2 slots, 3 are refused
        body["params"]["n"] = rng.choice([1, 2, 2, 3])
    if rng.random() < 0.1:
        body["params"] |= {"logprobs": rng.randint(0, 3), "prompt_logprobs": rng.random() < 0.5}
    return body


def _valid_message(rng: random.Random) -> tuple[wire.MsgType, dict[str, Any]]:
    kind = rng.random()
    if kind < 0.6:
        return wire.MsgType.REQUEST, _valid_request(rng)
    if kind < 0.65:  # refused: the fuzzed server has no embedding model
        return wire.MsgType.EMBED, {"id": rng.choice(IDS), "texts": rng.choice([["hi"], ["a", "b"], []])}
    if kind < 0.8:
        return wire.MsgType.CANCEL, {"id": rng.choice(IDS)}
    if kind < 0.95 or not CLIENT_SENT - {wire.MsgType.REQUEST, wire.MsgType.CANCEL, wire.MsgType.PING}:
        return wire.MsgType.PING, {"nonce": rng.randrange(1 << 32)}
    return wire.MsgType["STATS_QUERY"], {"nonce": rng.randrange(1 << 32)}


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


WEIRD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 127, 128, -129, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1, -(2**63),
    0.0, -0.0, 1e-300, 1e308, -1e308, float("inf"), float("-inf"), float("nan"), "", "x", "é" * 70, "x" * 5000,
    b"", b"\x00\xff", [], [1, 2, 3], [[[]]], {}, {"a": 1}, {"max_tokens": 4}, ["\n"], [1], [""],
    msgpack.ExtType(1, b"abc"), msgpack.Timestamp(1, 2),
]
FIELDS = ["id", "prompt", "params", "stream", "timeout", "model", "nonce", "texts", "tokens", "junk"]
PARAMS = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "repeat_penalty", "n", "logprobs",
          "prompt_logprobs", "mirostat"]


def random_frames(rng: random.Random) -> Frames:
    return [rng.randbytes(rng.choice([0, 1, 2, 4, 5, 16, 64, 300])) for _ in range(rng.randint(1, 9))]


def random_body(rng: random.Random) -> Frames:
    t = rng.choice(list(wire.MsgType))
    return [wire.VERSION, _type(t), rng.randbytes(rng.randint(0, 200))]


def mutated(rng: random.Random) -> Frames:
    """A valid message with a few bytes flipped, inserted, deleted or truncated, or frames shuffled."""
    t, body = _valid_message(rng)
    frames = [bytearray(wire.VERSION), bytearray(_type(t)), bytearray(_pack(body))]
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        f = frames[rng.randrange(len(frames))] if frames else bytearray()
        if op == 0 and f:
            f[rng.randrange(len(f))] ^= 1 << rng.randrange(8)
        elif op == 1 and f:
            f[rng.randrange(len(f))] = rng.randrange(256)
        elif op == 2:
            at = rng.randint(0, len(f))
            f[at:at] = rng.randbytes(rng.randint(1, 8))
        elif op == 3 and f:
            at = rng.randrange(len(f))
            del f[at:at + rng.randint(1, 8)]
        elif op == 4 and f:
            del f[rng.randint(0, len(f) - 1):]
        elif op == 5 and len(frames) > 1:
            frames.pop(rng.randrange(len(frames)))
        elif op == 6:
            frames.insert(rng.randint(0, len(frames)), bytearray(rng.randbytes(rng.randint(0, 8))))
        else:
            rng.shuffle(frames)
    return [bytes(f) for f in frames] or [b""]


def wrong_header(rng: random.Random) -> Frames:
    t, body = _valid_message(rng)
    version = rng.choice([wire.VERSION, b"", b"MPS0", b"MPS2", b"mps1", b"MPS1\x00", b"MPS", rng.randbytes(4)])
    type_frame = rng.choice([bytes([rng.randrange(256)]), b"", _type(t) * 2, bytes([t, 0])])
    if version == wire.VERSION and len(type_frame) == 1 and type_frame[0] in CLIENT_SENT:
        type_frame = _type(rng.choice(sorted(set(wire.MsgType) - CLIENT_SENT)))  # a type clients may not send
    return [version, type_frame, _pack(body)]


def wrong_fields(rng: random.Random) -> Frames:
    """Well-formed msgpack maps whose fields have the wrong types or values, or are missing or extra."""
    t, body = _valid_message(rng)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(5)
        if op == 0:
            body[rng.choice(FIELDS)] = rng.choice(WEIRD_VALUES)
        elif op == 1 and body:
            body.pop(rng.choice(list(body)))
        elif op == 2:
            params = body.setdefault("params", {})
            if isinstance(params, dict):
                params[rng.choice(PARAMS)] = rng.choice(WEIRD_VALUES)
        elif op == 3:
            body = rng.choice([[body], "map", 7, None, [], b"bytes", 1.5])  # not a map at all
            break
        else:
            body[rng.choice(["x" * 300, "", "id2"])] = rng.choice(WEIRD_VALUES)
    return [wire.VERSION, _type(t), _pack(body)]


def huge_numbers(rng: random.Random) -> Frames:
    t, body = _valid_message(rng)
    big = rng.choice([2**64 - 1, 2**63, 2**32, -(2**63), 2**53 + 1, -(2**53), 1e308, -1e308, float("inf"),
                      float("-inf"), float("nan"), 5e-324])
    if t is wire.MsgType.REQUEST:
        key = rng.choice(["max_tokens", "top_k", "seed", "temperature", "top_p", "repeat_penalty"])
        body["params"][key] = big
        if rng.random() < 0.3:
            body["timeout"] = big
    elif t is wire.MsgType.PING:
        body["nonce"] = big
    else:
        body["id"] = big
    return [wire.VERSION, _type(t), _pack(body)]


def raw_msgpack(rng: random.Random) -> Frames:
    """Bodies that msgpack builders would refuse to make: deep nesting, bad UTF-8, odd keys, lies about
    lengths, ext types, trailing garbage."""
    depth = rng.choice([10, 100, 1000, 5000, 100_000])
    t = _type(rng.choice(sorted(CLIENT_SENT)))
    choice = rng.randrange(9)
    if choice == 0:
        body = b"\x81\xa2id" + b"\x91" * depth + b"\xc0"  # {"id": [[[[…]]]]}
    elif choice == 1:
        body = b"\x81\xa1a" * depth + b"\xc0"  # {"a": {"a": {…}}}
    elif choice == 2:
        body = b"\x82\xa2id\xa3\xff\xfe\xfd\xa6prompt\xa2hi"  # a str that is not UTF-8
    elif choice == 3:
        body = _pack({1: 2, "id": "f1"})  # an integer key
    elif choice == 4:
        body = b"\xdf\xff\xff\xff\xff" + b"\xa2id\xa2f1"  # a map that claims 4 billion entries
    elif choice == 5:
        body = b"\xdb\x7f\xff\xff\xff" + b"x" * 10  # a str that claims 2 GiB
    elif choice == 6:
        body = b"\xc7\xff\x01" + b"e" * 255  # an ext type
    elif choice == 7:
        body = _pack({"id": "f2", "prompt": "hi"}) + rng.randbytes(rng.randint(1, 16))  # trailing bytes
    else:
        body = b"\xc1" + rng.randbytes(8)  # the never-used type byte
    return [wire.VERSION, t, body]


def big_but_allowed(rng: random.Random) -> Frames:
    """Large frames under the socket's size limit: a request with a large ignored field, a body just
    over the body limit, a prompt just over the prompt limit."""
    choice = rng.randrange(3)
    if choice == 0:
        body = _valid_request(rng)
        body["junk"] = rng.randbytes(rng.randint(1 << 20, wire.MAX_MESSAGE_BYTES - 1024))
        return [wire.VERSION, _type(wire.MsgType.REQUEST), _pack(body)]
    if choice == 1:
        return [wire.VERSION, _type(wire.MsgType.PING), b"\x00" * (wire.MAX_MESSAGE_BYTES + 100)]
    body = _valid_request(rng)
    body["prompt"] = "a" * (wire.MAX_PROMPT_CHARS + 1)
    return [wire.VERSION, _type(wire.MsgType.REQUEST), _pack(body)]


GENERATORS: list[tuple[float, Callable[[random.Random], Frames]]] = [
    (0.15, random_frames), (0.10, random_body), (0.30, mutated), (0.10, wrong_header), (0.20, wrong_fields),
    (0.07, huge_numbers), (0.076, raw_msgpack), (0.004, big_but_allowed),
]


def fuzz_messages(rng: random.Random, n: int, families: collections.Counter[str] | None = None) -> Iterator[Frames]:
    weights = [w for w, _ in GENERATORS]
    for _ in range(n):
        make = rng.choices(GENERATORS, weights)[0][1]
        if families is not None:
            families[make.__name__] += 1
        yield make(rng)


def test_the_generator_makes_every_kind_of_message() -> None:
    """Guard on the fuzzer itself: it reaches each family, oversized-but-allowed frames included."""
    rng = random.Random(SEED)
    families: collections.Counter[str] = collections.Counter()
    messages = list(fuzz_messages(rng, 3000, families))
    assert set(families) == {make.__name__ for _, make in GENERATORS}
    assert len({len(m) for m in messages}) >= 8
    assert any(len(f) > 1 << 20 for m in messages for f in m)
    assert max(len(f) for m in messages for f in m) < SIZE_LIMIT
    assert any(m[:2] == [wire.VERSION, _type(wire.MsgType.REQUEST)] and _decodes_as_request(m[2])
               for m in messages if len(m) == 3), "no mutated message is still a valid request"


def _decodes_as_request(body: bytes) -> bool:
    try:
        wire.decode_body(wire.MsgType.REQUEST, body)
    except MpserveError:
        return False
    return True


# --- the tests ----------------------------------------------------------------------------------

class Fuzzer:
    """Raw DEALERs that send fuzz messages and read every reply, checking each is a well-formed message of
    a kind the broker may send a client. Every ``ROTATE_EVERY`` messages the fuzzer drops its socket, with
    whatever requests it had pending, and carries on from a new one: a new client identity to the broker."""

    ROTATE_EVERY = 1000

    def __init__(self, address: str) -> None:
        self.address = address
        self.ctx = zmq.Context()
        self.sock = self._connect()
        self.sent = 0
        self.identities = 1
        self.nonce = 0
        self.replies: collections.Counter[str] = collections.Counter()
        self.last_reply = time.monotonic()

    def _connect(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.connect(self.address)
        return sock

    def send(self, frames: Frames) -> None:
        self.sock.send_multipart(frames)
        self.sent += 1
        self.drain()
        if self.sent % self.ROTATE_EVERY == 0:
            self.barrier()
            self.sock.close(0)
            self.sock = self._connect()
            self.identities += 1

    def barrier(self, timeout: float = 30.0) -> None:
        """Wait until the broker has taken everything sent so far: it answers a connection's messages in
        order, so the PONG to a fresh nonce comes after all of them."""
        self.nonce += 1
        nonce = (1 << 40) + self.nonce  # no fuzz PING uses a nonce this high
        self.sock.send_multipart([wire.VERSION, _type(wire.MsgType.PING), _pack({"nonce": nonce})])
        deadline = time.monotonic() + timeout
        while True:
            assert self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))), "no PONG to the barrier"
            msg = self._take(self.sock.recv_multipart())
            if isinstance(msg, wire.Pong) and msg.nonce == nonce:
                return

    def drain(self, wait_ms: int = 0) -> int:
        got = 0
        while self.sock.poll(wait_ms if got == 0 else 0):
            self._take(self.sock.recv_multipart())
            got += 1
        return got

    def _take(self, frames: Frames) -> Any:
        msg = wire.decode(frames)  # the server never sends a malformed message
        assert msg.TYPE in CLIENT_BOUND, msg
        for one in msg.chunks if isinstance(msg, wire.Chunks) else (msg,):  # a step's chunks travel together
            self.replies[one.code if isinstance(one, wire.Error) else type(one).__name__.lower()] += 1
        self.last_reply = time.monotonic()
        return msg

    def settle(self, quiet_s: float = 1.0, timeout: float = 60.0) -> None:
        """Cancel whatever valid requests got through, then read until the server has been quiet a while."""
        for rid in IDS:
            self.sock.send_multipart([wire.VERSION, _type(wire.MsgType.CANCEL), _pack({"id": rid})])
        deadline = time.monotonic() + timeout
        while time.monotonic() - self.last_reply < quiet_s:
            assert time.monotonic() < deadline, "the server kept answering the fuzzer for a minute"
            self.drain(wait_ms=50)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def quiesce(server: Any, fuzzer: Fuzzer) -> wire.Stats:
    """Settle the fuzzer, wait until the broker holds no request (those of dropped fuzz sockets included:
    they end when the broker finds the client gone or expires it), then check a normal request succeeds."""
    fuzzer.settle()
    with Client(server.address) as client:
        deadline = time.monotonic() + 30
        while True:
            stats = client.stats()
            if all(m.queued == m.running == 0 for m in stats.models.values()):
                break
            assert time.monotonic() < deadline, f"the broker still holds fuzz requests: {stats}"
            time.sleep(0.05)
        result = client.generate("after the storm", max_tokens=8, temperature=0, timeout=30)
    assert result.usage.completion_tokens == 8
    return stats


@pytest.mark.timeout(180)
def test_ten_thousand_fuzz_messages_neither_crash_nor_leak_nor_stop_the_server(start_server) -> None:
    # glibc raises its mmap threshold after the first multi-MiB buffer is freed, and then keeps freed
    # memory at the top of its heaps: the broker's RSS would swing by tens of MiB with where the last
    # big-but-allowed message fell, leak or no leak. A fixed mmap threshold (big buffers go back to the
    # kernel when freed) and a low trim threshold make RSS measure what the broker holds on to.
    server = start_server("--instances", "1", "--parallel", "2", "--threads", "1", env=MALLOC_ENV).wait_ready()
    pid = server.proc.pid
    rng = random.Random(SEED)
    fuzzer = Fuzzer(server.address)
    try:
        for frames in fuzz_messages(rng, WARMUP_MESSAGES):
            fuzzer.send(frames)
        quiesce(server, fuzzer)
        rss_before = rss_kib(pid)
        started = time.monotonic()
        families: collections.Counter[str] = collections.Counter()
        for frames in fuzz_messages(rng, FUZZ_MESSAGES, families):
            fuzzer.send(frames)
        fuzz_s = time.monotonic() - started
        assert server.proc.poll() is None, "\n".join(server.log)
        stats = quiesce(server, fuzzer)
        rss_after = rss_kib(pid)
        growth = (rss_after - rss_before) / rss_before
        print(f"\nfuzz: {WARMUP_MESSAGES} warm-up + {FUZZ_MESSAGES} messages (seed {SEED}) from "
              f"{fuzzer.identities} client identities, sent in {fuzz_s:.1f} s; kinds {dict(families)}; "
              f"replies {dict(fuzzer.replies)}; "
              f"broker counters {stats.counters}; broker RSS {rss_before / 1024:.1f} MiB after warm-up, "
              f"{rss_after / 1024:.1f} MiB at the end ({growth:+.1%})")
        assert growth <= RSS_GROWTH_LIMIT
        assert fuzzer.replies["protocol"] > 0 and fuzzer.replies["bad_request"] > 0 and fuzzer.replies["pong"] > 0
        assert fuzzer.replies["internal"] == 0, "a fuzz message hit a bug (internal error); see the server log"
        assert not server.tracebacks(), "\n".join(server.log)
    finally:
        fuzzer.close()


@pytest.mark.timeout(60)
def test_a_message_over_the_size_limit_drops_the_connection_and_the_server_lives_on(start_server) -> None:
    server = start_server("--instances", "1", "--threads", "1").wait_ready()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    sock.connect(server.address)
    try:
        def next_event(timeout_s: float) -> int:
            assert monitor.poll(int(timeout_s * 1000)), "no socket event in time"
            return zmq.utils.monitor.recv_monitor_message(monitor)["event"]

        assert next_event(10) == zmq.EVENT_CONNECTED
        ping = [wire.VERSION, _type(wire.MsgType.PING), _pack({"nonce": 7})]
        sock.send_multipart(ping)
        assert sock.poll(5000) and isinstance(wire.decode(sock.recv_multipart()), wire.Pong)

        for size in (SIZE_LIMIT + 1, 16 * 1024 * 1024):
            body = _pack({"id": "big", "prompt": "x" * size})
            sock.send_multipart([wire.VERSION, _type(wire.MsgType.REQUEST), body])
            assert next_event(10) == zmq.EVENT_DISCONNECTED, "the oversized message did not cost the connection"
            assert server.proc.poll() is None, "\n".join(server.log)
            # the DEALER reconnects by itself; nothing ever answers the oversized message
            assert next_event(10) == zmq.EVENT_CONNECTED
            sock.send_multipart(ping)
            assert sock.poll(5000)
            reply = wire.decode(sock.recv_multipart())
            assert isinstance(reply, wire.Pong) and reply.nonce == 7, reply

        # a body over the body limit but under the socket's limit is answered with a protocol error
        sock.send_multipart([wire.VERSION, _type(wire.MsgType.REQUEST), b"\x00" * (wire.MAX_MESSAGE_BYTES + 1)])
        assert sock.poll(5000)
        err = wire.decode(sock.recv_multipart())
        assert isinstance(err, wire.Error) and err.code == "protocol", err

        with Client(server.address) as client:
            assert client.generate("still here", max_tokens=4, temperature=0, timeout=30).usage.completion_tokens == 4
        assert not server.tracebacks(), "\n".join(server.log)
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        ctx.term()

