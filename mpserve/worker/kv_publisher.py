"""A worker's KV events on ZeroMQ, as vLLM's ``ZmqEventPublisher`` sends them (``mpserve.wire.kv_events``): a PUB
socket, and a ROUTER that replays the batches a subscriber missed.

    each turn of the worker loop ──turn(engine)──▶ Ledger.observe(engine.kv_held()): the blocks its slots gained
        and lost (medium GPU), and Ledger.entry(engine.kv_stored()): those of the host-store entries it wrote and
        removed (medium CPU) ──▶ KVEventBatch(ts, events, rank)
        ──▶ PUB [topic, seq as 8 bytes big-endian, msgpack] ──▶ the replay ring
    ROUTER [identity, b"", start seq] ──▶ [identity, b"", seq, payload] for each batch kept from start on, then
        [identity, b"", -1 as 8 signed bytes, b""]

The first batch says AllBlocksCleared (a new instance holds nothing, whatever a subscriber knew of its rank), and so
does the batch after the model is unloaded and the last one, as the worker leaves. The rank is the instance's index
in its server, the topic ``kv@HOST@MODEL`` (llm-d's; HOST: the host's name, a pod's name on Kubernetes).

Where it goes (``--kv-events``), vLLM's rule: an address with a wildcard (``tcp://*:PORT``), or ``ipc://``, is
bound, each instance on its own: instance i publishes on PORT + 2i and replays on PORT + 2i + 1 (``ipc://PATH``:
PATH-wI and PATH-wI.replay); any other address (``tcp://indexer:5557``, a subscriber that binds, as llm-d's KV
indexer does) is connected to by every instance, with no replay socket. Nothing here blocks a step: PUB drops what a
slow subscriber cannot take (past its high-water mark), and a replay request waits for the next turn of the loop,
within a heartbeat interval when the worker is idle.
"""

from __future__ import annotations

import collections
import logging
import socket
import time
from typing import Any, Protocol, runtime_checkable

import zmq

from mpserve.engine.kv_events import Held, Ledger
from mpserve.wire.kv_events import MEDIUM_CPU, MEDIUM_GPU, Event, KVEventBatch, encode_batch, topic

log = logging.getLogger("mpserve.worker")

REPLAY_BATCHES = 10_000  # batches kept for replay (vLLM's buffer_steps)
HIGH_WATER_MARK = 100_000
END_SEQ = (-1).to_bytes(8, "big", signed=True)
LINGER_MS = 1000  # what a leaving instance waits for its last batch to go out


@runtime_checkable
class HoldsCells(Protocol):
    """An engine whose slots hold KV cells (``BatchEngine``; the echo and embedding engines hold none)."""

    def kv_held(self) -> list[Held]: ...

    def kv_stored(self) -> list[tuple[str, Held | None]]: ...


def addresses(endpoint: str, index: int) -> tuple[str, str | None, bool]:
    """Instance ``index``'s PUB address, its replay address (None: none), and whether it binds them."""
    if endpoint.startswith("ipc://"):
        return f"{endpoint}-w{index}", f"{endpoint}-w{index}.replay", True
    if "*" not in endpoint and "::" not in endpoint:
        return endpoint, None, False
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + 2 * index}", f"{base}:{int(port) + 2 * index + 1}", True


class KvPublisher:
    def __init__(self, endpoint: str, index: int, model: str) -> None:
        pub, replay, binds = addresses(endpoint, index)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(HIGH_WATER_MARK)
        self._replay: zmq.Socket[Any] | None = None
        try:
            if binds:
                self._pub.bind(pub)
                assert replay is not None
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay)
            else:
                self._pub.connect(pub)
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)  # a context left with open sockets would hang the process's exit
            raise
        log.info("KV events on %s%s (their token ids are the prompts: keep the port to the picker, "
                 "docs/security.md)", pub, f", replayed on {replay}" if self._replay is not None else "")
        self._index = index
        self._topic = topic(socket.gethostname(), model)
        self._seq = 0
        self._ring: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=REPLAY_BATCHES)
        self._ledger, self._store = Ledger(MEDIUM_GPU), Ledger(MEDIUM_CPU)
        self._send(self._ledger.clear())

    @property
    def published(self) -> int:
        """The sequence number of the last batch sent (-1: none yet)."""
        return self._seq - 1

    def turn(self, engine: object) -> None:
        """Publish what changed in ``engine``'s cells (None: unloaded) since the last turn; answer replay requests."""
        if isinstance(engine, HoldsCells):
            stored = [event for name, held in engine.kv_stored() for event in self._store.entry(name, held)]
            self._send(self._ledger.observe(engine.kv_held()) + stored)
        elif self._ledger.hashes() or self._store.hashes():
            self._store.clear()
            self._send(self._ledger.clear())
        self._serve_replays()

    def close(self) -> None:
        """The instance leaves: it holds nothing now (its host-store entries stay, but no instance tells of them)."""
        self._send(self._ledger.clear())
        self._ctx.destroy(linger=LINGER_MS)

    def _send(self, events: list[Event]) -> None:
        if not events:
            return
        payload = encode_batch(KVEventBatch(time.time(), events, self._index))
        seq = self._seq.to_bytes(8, "big")
        self._pub.send_multipart((self._topic, seq, payload), zmq.NOBLOCK)
        self._ring.append((self._seq, payload))
        self._seq += 1

    def _serve_replays(self) -> None:
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("a KV events replay request of %d frames ignored", len(frames))
                continue
            peer, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in self._ring:
                if seq >= start:
                    self._replay.send_multipart((peer, b"", seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
            self._replay.send_multipart((peer, b"", END_SEQ, b""), zmq.NOBLOCK)


def open_publisher(endpoint: str, index: int, model: str) -> KvPublisher | None:
    """The instance's publisher, or None without an address; one that cannot bind is logged and left out (the
    instance serves without KV events rather than not at all)."""
    if not endpoint:
        return None
    try:
        return KvPublisher(endpoint, index, model)
    except (zmq.ZMQError, ValueError) as exc:
        log.error("no KV events: %s cannot be used (%s)", endpoint, exc)
        return None
