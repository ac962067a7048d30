"""KV events of a real engine (the tiny model, two slots) on real ZeroMQ sockets: a subscriber decodes the batches of
a run and rebuilds which blocks the instance holds; at every point it caught up, they are the blocks its slots' cells
hold, hashed by the documented recipe from the cells' tokens alone, and a prompt's own blocks, hashed from its text's
tokens, are among them while a slot holds it. It joins late, so it misses the first batch and recovers it from the
replay socket; a second subscriber made only of replays rebuilds the same. The host store's entries that the instance
writes are told under the medium CPU, with the same hashes as the cells they were saved from."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from engines import LONG_PROMPT, N_CTX, make_engine
from helpers import free_port

from mpserve.engine.batch import BatchEngine
from mpserve.engine.settings import EngineSettings
from mpserve.wire.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockStored, block_hashes, decode_batch
from mpserve.wire.protocol import GenerateParams
from mpserve.worker.kv_publisher import END_SEQ, KvPublisher

SYSTEM = "You are a helpful assistant who answers in one short sentence and never says more. " * 2
PROMPTS = [SYSTEM + "What is the capital of France?", SYSTEM + "Name a color of the rainbow.",
           "Once upon a time, in a land far away, there lived a dragon who collected old clocks and kept them."]


class Subscriber:
    """A SUB socket and a DEALER to the replay socket: batches applied in sequence order, a gap filled by replay."""

    def __init__(self, ctx: zmq.Context[Any], port: int, live: bool = True) -> None:
        self.held: set[int] = set()  # the instance's cells (medium GPU)
        self.stored: set[int] = set()  # the host store's entries it wrote (medium CPU)
        self.next = 0
        self.replayed = 0
        self._pump: Callable[[], None] = lambda: None
        self.sub: zmq.Socket[Any] | None = None
        if live:
            self.sub = ctx.socket(zmq.SUB)
            self.sub.connect(f"tcp://127.0.0.1:{port}")
            self.sub.subscribe(b"kv@")
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(f"tcp://127.0.0.1:{port + 1}")

    def catch_up(self, last: int, pump: Callable[[], None]) -> None:
        """Apply every batch up to sequence number ``last``; ``pump``: a turn of the publisher (it answers replay
        requests in its turns, in this thread)."""
        self._pump = pump
        deadline = time.monotonic() + 30
        while self.next <= last:
            assert time.monotonic() < deadline, f"batch {self.next} never came, live or replayed"
            if self.sub is not None and self.sub.poll(200):
                _topic, seq, payload = self.sub.recv_multipart()
                number = int.from_bytes(seq, "big")
                if number > self.next:
                    self._replay()  # it missed some: recover them, then this one is old news or next
                if number == self.next:
                    self._apply(payload)
            else:
                self._replay()

    def _replay(self) -> None:
        self.replay.send_multipart([b"", self.next.to_bytes(8, "big")])
        while True:
            deadline = time.monotonic() + 10
            while not self.replay.poll(10):
                assert time.monotonic() < deadline, "the replay socket did not answer"
                self._pump()
            _, seq, payload = self.replay.recv_multipart()
            if seq == END_SEQ:
                return
            if int.from_bytes(seq, "big") == self.next:
                self.replayed += 1
                self._apply(payload)

    def _apply(self, payload: bytes) -> None:
        for event in decode_batch(payload).events:
            if isinstance(event, AllBlocksCleared):
                self.held.clear()
                self.stored.clear()
                continue
            blocks = self.held if event.medium == MEDIUM_GPU else self.stored
            if isinstance(event, BlockStored):
                blocks |= set(event.block_hashes)
            else:
                blocks -= set(event.block_hashes)
        self.next += 1


@pytest.fixture(scope="module")
def engine(tiny_model_path: str) -> Iterator[BatchEngine]:
    engine = make_engine(tiny_model_path, parallel=2)
    yield engine
    engine.close()


def bound() -> tuple[int, KvPublisher]:
    """A publisher on a free port whose next one (its replay socket's) is free too."""
    for _ in range(20):
        port = free_port()
        try:
            return port, KvPublisher(f"tcp://*:{port}", 0, "tiny")
        except zmq.ZMQError:
            continue  # the next port was taken
    raise AssertionError("no two free ports in a row")


def holds(engine: BatchEngine) -> set[int]:
    """The blocks the engine's slots hold, by the documented recipe over their cells' tokens."""
    return {h for held in engine.kv_held() for h in block_hashes(held.tokens, held.key)}


@pytest.mark.timeout(120)
def test_a_subscriber_rebuilds_the_blocks_the_slots_hold_and_recovers_what_it_missed(engine: BatchEngine) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    port, publisher = bound()  # its first batch goes before anyone subscribes
    live = Subscriber(ctx, port)
    try:
        pending = list(PROMPTS)
        checked = 0
        while pending or engine.active:
            for slot in engine.free_slots():
                if pending:
                    prompt = pending.pop(0)
                    engine.admit(slot, prompt, GenerateParams(max_tokens=24, temperature=0.0), lambda text, n: True)
                    mine = block_hashes(engine.tokenize(prompt, True))
            engine.step()
            publisher.turn(engine)
            live.catch_up(publisher.published, lambda: publisher.turn(engine))
            assert live.held == holds(engine)
            checked += 1
        assert set(mine) <= live.held  # the last prompt's blocks, from its text alone
        assert live.replayed >= 1  # it missed the first batch
        engine.erase_slot(0)
        publisher.turn(engine)
        live.catch_up(publisher.published, lambda: publisher.turn(engine))
        assert live.held == holds(engine) and live.held
        late = Subscriber(ctx, port, live=False)
        late.catch_up(publisher.published, lambda: publisher.turn(engine))
        assert late.held == live.held
        publisher.turn(None)  # unloaded: nothing held
        live.catch_up(publisher.published, lambda: publisher.turn(None))
        assert live.held == set()
        assert checked > 10
    finally:
        publisher.close()
        ctx.destroy(linger=0)


@pytest.mark.timeout(120)
def test_the_host_store_entries_it_writes_are_told_under_the_cpu_medium(tiny_model_path: str, tmp_path: Path) -> None:
    engine = BatchEngine(EngineSettings(tiny_model_path, n_ctx=N_CTX, parallel=2, threads=1, n_gpu_layers=0,
                                        cache_ram=64 << 20, cache_shm=str(tmp_path)))
    ctx: zmq.Context[Any] = zmq.Context()
    port, publisher = bound()
    subscriber = Subscriber(ctx, port)
    try:
        engine.admit(0, LONG_PROMPT, GenerateParams(max_tokens=2, temperature=0.0), lambda text, n: True)
        computed: set[int] = set()  # every block the cells held at some step
        while engine.active:
            engine.step()
            publisher.turn(engine)
            computed |= holds(engine)
        chunk = block_hashes(engine.tokenize(LONG_PROMPT, True)[:512])  # the store keeps whole 512-token chunks
        deadline = time.monotonic() + 30
        while not set(chunk) <= subscriber.stored:  # the store's writer thread writes in the background
            assert time.monotonic() < deadline, "the first chunk's entry was never told"
            publisher.turn(engine)
            subscriber.catch_up(publisher.published, lambda: publisher.turn(engine))
        assert subscriber.stored <= computed  # its entries hold what the cells computed, under the same hashes
    finally:
        publisher.close()
        ctx.destroy(linger=0)
        engine.close()


@pytest.mark.timeout(120)
def test_a_server_started_with_kv_events_publishes_its_instances_blocks(start_server: Any, tmp_path: Path) -> None:
    """``--kv-events`` reaches each instance from the server's configuration: a request's prompt is told as stored
    blocks on instance 0's socket."""
    from mpserve.client import Client

    endpoint = f"ipc://{tmp_path}/kv"
    server = start_server("--model", "builtin:tiny", "--kv-events", endpoint).wait_ready()
    ctx: zmq.Context[Any] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(f"{endpoint}-w0")
        sub.subscribe(b"kv@")
        stored: list[BlockStored] = []
        with Client(server.address) as client:
            deadline = time.monotonic() + 30
            while not stored:  # a subscriber joining a PUB socket misses what went before: ask until one is heard
                assert time.monotonic() < deadline, "no BlockStored from the server's instance"
                client.generate(LONG_PROMPT, max_tokens=2, temperature=0)
                while sub.poll(500):
                    stored += [e for e in decode_batch(sub.recv_multipart()[2]).events if isinstance(e, BlockStored)]
        assert all(e.block_size == 16 and e.block_hashes for e in stored)
    finally:
        sub.close(0)
        ctx.term()
