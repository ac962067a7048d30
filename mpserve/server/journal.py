"""The broker's journal: what a server that dies leaves of its live requests, for the next start to go on with those
no surviving instance brings (queued ones, and running ones whose instance died too or had been handed them), from
the tokens they streamed, nothing computed again.

    the broker, as it goes (records gathered; one write a loop turn, at ``flush``)
        a request queued, or held for its client again ─▶ BEGIN: its ticket, model, choice, attempts, its request
        a CHUNK forwarded ─▶ CHUNK: its token ids and its body
        a row's text let go (past its bounds), or its tokens unknown ─▶ LOST: it cannot be resumed
        a row ends, or is forgotten ─▶ END
        past COMPACT_BYTES written ─▶ the file written anew with the live rows alone, renamed over it
    NAME.journal: the runtime folder (0700), a file of this user's (0600: ``create_private``), never through a link
    the next start ─▶ read(name) before it writes its own: each row begun and neither ended nor lost, its tokens and
             its text ─▶ ``Adopter.journaled``: held for their clients as an adoptee's requests are, parked nowhere
             (a reattach resumes each from its tokens, its text sent first), after what the adoptees bring

A frame is a 4-byte length and a msgpack array of records; a frame cut short (the server died writing it) ends the
reading, and a file that is not this user's own is not read.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec

from mpserve.errors import MpserveError
from mpserve.private import PlantedFile, create_private, open_private
from mpserve.runtime import runtime_dir
from mpserve.wire import protocol as wire

from .state import Pending, RequestState

log = logging.getLogger("mpserve.broker")

BEGIN, CHUNK, LOST, END = range(4)
COMPACT_BYTES = 64 << 20  # written since the last compaction: then the live rows alone are written anew
MAX_READ_BYTES = 1 << 30  # a journal larger than this is not read
LENGTH = struct.Struct("<I")


class Record(msgspec.Struct, array_like=True, frozen=True):
    """One thing that happened to row ``ticket``: BEGIN (``data``: its request, packed), CHUNK (``data``: token ids,
    ``body``: the CHUNK's), LOST or END."""

    kind: int
    ticket: str
    data: bytes = b""
    body: bytes = b""
    model: str = ""
    index: int = 0
    attempts: int = 0


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(list[Record])


def path_of(name: str) -> Path:
    return runtime_dir() / f"{name}.journal"


class Journal:
    """This start's journal (``path`` None: none is kept)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.records: list[Record] = []
        self.written = 0  # bytes in the file
        self.floor = 0  # ... after the last compaction
        self._fd = self._create(path) if path is not None else None

    @staticmethod
    def _create(path: Path) -> int:
        path.unlink(missing_ok=True)
        return create_private(path, os.O_WRONLY | os.O_APPEND)

    def begin(self, p: Pending) -> None:
        if self._fd is not None:
            self.records.append(Record(BEGIN, p.ticket, wire.pack(p.request), b"", p.model, p.index, p.attempts))

    def chunk(self, p: Pending, tokens: bytes | None, body: bytes) -> None:
        if self._fd is not None:
            self.records.append(Record(CHUNK, p.ticket, tokens or b"", body) if tokens is not None
                                else Record(LOST, p.ticket))

    def whole(self, p: Pending) -> None:
        """``p`` as it is now: BEGIN, its tokens and its text kept (LOST if it keeps none)."""
        if self._fd is None:
            return
        self.begin(p)
        self.records.append(Record(CHUNK, p.ticket, bytes(p.generated)))
        if p.kept is None or not p.tokens_known:
            self.records.append(Record(LOST, p.ticket))
        else:
            self.records.extend(Record(CHUNK, p.ticket, b"", body) for body in p.kept)

    def lost(self, p: Pending) -> None:
        if self._fd is not None:
            self.records.append(Record(LOST, p.ticket))

    def end(self, p: Pending) -> None:
        if self._fd is not None:
            self.records.append(Record(END, p.ticket))

    def flush(self, live: Callable[[], Iterable[Pending]]) -> None:
        """Write what was gathered; COMPACT_BYTES past the last compaction, the ``live()`` rows alone, in a file
        renamed over it."""
        self._write()
        if self._fd is not None and self.written > self.floor + COMPACT_BYTES:
            self._compact(live())

    def _write(self) -> None:
        if self._fd is None or not self.records:
            return
        data = _ENCODER.encode(self.records)
        self.records.clear()
        try:
            os.write(self._fd, LENGTH.pack(len(data)) + data)
        except OSError as exc:
            log.error("the journal %s cannot be written (%s); a restart will not find the requests in flight",
                      self.path, exc)
            self.close()
            return
        self.written += len(data) + LENGTH.size

    def _compact(self, live: Iterable[Pending]) -> None:
        assert self.path is not None and self._fd is not None
        fresh = Journal(self.path.with_suffix(".journal-new"))
        for p in live:
            if not p.answered:
                fresh.whole(p)
        fresh._write()
        os.replace(fresh.path or self.path, self.path)
        os.close(self._fd)
        self._fd, fresh._fd, self.written, self.floor = fresh._fd, None, fresh.written, fresh.written

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def remove(self) -> None:
        """A clean stop: nothing is left in flight."""
        self.close()
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def read(path: Path) -> list[tuple[Pending, str]]:
    """The rows the journal at ``path`` has begun and neither ended nor lost: each as a request held for its client
    (no client, its tokens and state), with the text it streamed."""
    try:
        fd = open_private(path)
    except FileNotFoundError:
        return []
    except PlantedFile as exc:
        log.warning("not reading the journal %s: it is not a file of this user's own (%s)", path, exc)
        return []
    with os.fdopen(fd, "rb") as file:
        data = file.read(MAX_READ_BYTES + 1)
    if len(data) > MAX_READ_BYTES:
        log.warning("not reading the journal %s: larger than %d bytes", path, MAX_READ_BYTES)
        return []
    rows: dict[str, tuple[Record, bytearray, list[bytes]]] = {}
    for record in _records(data):
        if record.kind == BEGIN:
            rows[record.ticket] = (record, bytearray(), [])
        elif record.kind == CHUNK and record.ticket in rows:
            _, tokens, bodies = rows[record.ticket]
            tokens += record.data
            if record.body:
                bodies.append(record.body)
        else:
            rows.pop(record.ticket, None)
    return [row for row in (_row(*one) for one in rows.values()) if row is not None]


def _records(data: bytes) -> Iterable[Record]:
    at = 0
    while at + LENGTH.size <= len(data):
        (size,) = LENGTH.unpack_from(data, at)
        frame = data[at + LENGTH.size:at + LENGTH.size + size]
        if len(frame) < size:
            return  # cut short: the server died writing it
        try:
            yield from _DECODER.decode(frame)
        except msgspec.DecodeError:
            return
        at += LENGTH.size + size


def _row(begun: Record, tokens: bytearray, bodies: list[bytes]) -> tuple[Pending, str] | None:
    """A row as ``Adopter.journaled`` holds it, or None if it does not decode (it runs anew if sent again)."""
    try:
        req = wire.decode_body(wire.MsgType.REQUEST, begun.data)
        chunks = [wire.decode_body(wire.MsgType.CHUNK, body) for body in bodies]
    except MpserveError:
        return None
    assert isinstance(req, wire.Request)
    text = "".join(c.text for c in chunks if isinstance(c, wire.Chunk))
    if len(tokens) % 4:
        return None
    now = time.monotonic()
    return Pending(begun.ticket, b"", req, begun.model, now, None, attempts=max(1, begun.attempts),
                   generated=tokens, index=begun.index, tenant=req.tenant, priority=req.priority,
                   first_assigned=now, first_token=now if text else 0.0,
                   state=RequestState.STREAMING if text else RequestState.QUEUED), text
