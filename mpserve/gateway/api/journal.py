"""Streams that outlive their connection: each event of a resumable stream is written to the gateway's SQLite
file as it is made, so that a client that lost its connection reads on from the last event it had, through any
gateway process of the port.

    producer (a task of its own, apart from any connection: ``Journal.produce``)
        the dialect's event batches ──split into events──▶ rows (owner, key, seq 0, 1, …) ──▶ the stream's end
        no reader for GRACE_S (a stream, not a background response) ──▶ stopped: its generation cancelled
        (looked at with each batch, and every SEEN_EVERY_S that brings none)
    reader (an HTTP answer: ``Journal.tail``)
        rows with seq > after, each as ``id: SEQ`` + its event ──▶ waits for more (woken at once in the
        producing process, every POLL_S from another) ──▶ the stream's end
    takeover (a reader whose stream's producing process died before the end: ``Journal.take_over``)
        the stream claimed for this process (one reader wins) ──▶ the pieces of text each journaled batch was
        made of ──▶ a new producer: the request sent again (``reattach``), the text it had dropped as it comes
        again, the dialect's state rebuilt from those pieces, its events numbered on from the last journaled
        a stream that cannot be taken over (a background response: no body to send again; one being cancelled)
        ──▶ what was journaled, then the dialect's error event (``connection``): the client sends it again

A stream is keyed by its owner (the caller's key, ``dialect.owner``) and a key: a chat or completions stream's
``X-Request-Id`` (the caller's), a background response's id. Its ``digest`` is its request body's: a resume that
names the key with another body is refused (409). Ended streams are kept KEEP_S, then dropped as new ones begin;
an owner keeps at most MAX_STREAMS of them, and their bytes count in the stored responses' budget from their end
(``response_store.make_room``: past it, the oldest ended streams go first). A background response deleted
(``DELETE /v1/responses/{id}``: ``Journal.delete``) goes at once, events, request and all; its producer, in this
process or another, writes nothing more and stops at its next batch. The file is ``response_store``'s (the same
private file).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from mpserve.errors import BadRequest, Cancelled, ConnectionFailed, MpserveError
from mpserve.runtime import pid_alive
from mpserve.waits import within

from .response_store import SCHEMA as STORE_SCHEMA
from .response_store import StoreBudget, drop_stream, make_room, open_db

log = logging.getLogger("mpserve.gateway")

GRACE_S = 10.0  # how long a stream without a reader runs on, for its client to come back
KEEP_S = 600.0  # how long an ended stream can still be read again
MAX_STREAMS = 256  # streams kept per owner, the oldest ended ones dropped first
POLL_S = 0.05  # how often a reader in another process looks for new events
SEEN_EVERY_S = 1.0  # how often a reader marks the stream as read (``seen``), for the producer's grace

_SCHEMA = """
CREATE TABLE IF NOT EXISTS streams (
    owner TEXT NOT NULL,
    key TEXT NOT NULL,
    digest TEXT NOT NULL,     -- its request body's
    pid INTEGER NOT NULL,     -- the gateway process producing it
    state TEXT NOT NULL,      -- running, cancelling (asked to stop), ended, cancelled
    started REAL NOT NULL,    -- wall clock (seconds since the epoch): read by other processes
    seen REAL NOT NULL,       -- a reader's latest look
    ended REAL,
    head BLOB,                -- what a background response is while it runs (its object, JSON)
    PRIMARY KEY (owner, key)
);
CREATE TABLE IF NOT EXISTS events (
    owner TEXT NOT NULL,
    key TEXT NOT NULL,
    seq INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (owner, key, seq)
);
CREATE TABLE IF NOT EXISTS asked (  -- a background response's request, for a takeover
    owner TEXT NOT NULL,
    key TEXT NOT NULL,
    request BLOB NOT NULL,    -- JSON, as the pipeline keeps it
    PRIMARY KEY (owner, key)
);
CREATE TABLE IF NOT EXISTS fed (  -- the text a batch of events was made of, for a takeover
    owner TEXT NOT NULL,
    key TEXT NOT NULL,
    seq INTEGER NOT NULL,     -- the batch's first event's
    pieces BLOB NOT NULL,     -- JSON: [[choice index, text], ...] in the order the dialect took them
    PRIMARY KEY (owner, key, seq)
);
"""

Pieces = list[tuple[int, str]]
"""Streamed text as the dialect took it: (choice index, piece), in order."""


class NoStream(BadRequest):
    """No stream of that key to read on (never started, ended too long ago, or another caller's): 404."""


@dataclass(frozen=True)
class Stream:
    state: str
    pid: int
    digest: str
    head: bytes | None


@dataclass(frozen=True)
class Taken:
    """A stream this process took over: the seq its next event gets, the pieces its events were made of, and for a
    background response its head and request (``begin``'s)."""

    next_seq: int
    pieces: Pieces
    head: bytes | None = None
    request: bytes | None = None


class Journal:
    """The streams of this gateway's port, in the SQLite file at ``path``."""

    def __init__(self, path: Path, budget: StoreBudget | None = None) -> None:
        """``budget``: the stored responses' (the default's without), which an ended stream's bytes count in
        (``make_room``)."""
        self._budget = budget or StoreBudget()
        self._db = open_db(path, STORE_SCHEMA + _SCHEMA)
        self._lock = threading.Lock()
        self._wake: dict[tuple[str, str], asyncio.Event] = {}  # streams produced here: their readers' bell
        self._cancel: dict[tuple[str, str], asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # the producers

    async def close(self) -> None:
        """Every stream produced here stopped (its generation cancelled, its state written), then the file."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with self._lock:
            self._db.close()

    # --- producing ---

    def begin(self, owner: str, key: str, digest: str, head: bytes | None = None, request: bytes | None = None
              ) -> None:
        """A new stream ``key``; BadRequest if one of that key is running. ``head`` and ``request``: a background
        response's object while it runs, and its request as ``take_over`` gives it back."""
        now = time.time()
        with self._transaction() as db:
            _forget_old(db, owner, now)
            row = db.execute("SELECT state, pid FROM streams WHERE owner = ? AND key = ?", (owner, key)).fetchone()
            if row is not None and row[0] in ("running", "cancelling") and (row[1] == os.getpid()
                                                                            or pid_alive(row[1])):
                raise BadRequest(f"a stream with request id {key!r} is running; resume it (send the header "
                                 "Last-Event-ID with the id of the last event you have) or use another id")
            drop_stream(db, owner, key)
            db.execute("INSERT INTO streams (owner, key, digest, pid, state, started, seen, head) "
                       "VALUES (?, ?, ?, ?, 'running', ?, ?, ?)", (owner, key, digest, os.getpid(), now, now, head))
            if request is not None:
                db.execute("INSERT INTO asked (owner, key, request) VALUES (?, ?, ?)", (owner, key, request))
        self._produced_here(owner, key)

    def _produced_here(self, owner: str, key: str) -> None:
        self._wake[owner, key] = asyncio.Event()
        self._cancel[owner, key] = asyncio.Event()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """The file, in a transaction that holds its write lock from the start (committed unless this raises)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def produce(self, owner: str, key: str, frames: AsyncGenerator[bytes, None], background: bool = False,
                fed: Pieces | None = None, start: int = 0) -> None:
        """Run ``frames`` (the stream's event batches) to its end in a task of its own, journaling each event,
        numbered from ``start``. ``fed``: a list the frames append the pieces of text they take to; each batch's
        are journaled with it (and the list emptied), for a takeover. Unless ``background``, the stream is
        stopped (``frames`` closed: its generation cancelled) once no reader has looked at it for GRACE_S."""
        task = asyncio.get_running_loop().create_task(self._produce(owner, key, frames, background, fed, start))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _produce(self, owner: str, key: str, frames: AsyncGenerator[bytes, None], background: bool,
                       fed: Pieces | None, seq: int) -> None:
        state = "ended"
        cancel = self._cancel[owner, key]
        try:
            async with contextlib.aclosing(_until(frames, cancel, SEEN_EVERY_S)) as batches:
                async for batch in batches:  # None: a look at its readers with no batch since SEEN_EVERY_S
                    written = seq if batch is None else self._journaled(owner, key, seq, batch, fed)
                    if written is None:
                        state = "cancelled"  # deleted meanwhile
                        break
                    seq = written
                    seen, now_state = self._look(owner, key)
                    if now_state == "cancelling" or (not background and time.time() - seen > GRACE_S):
                        state = "cancelled"
                        break
                else:
                    if cancel.is_set():
                        state = "cancelled"
        except asyncio.CancelledError:
            state = "cancelled"  # the gateway stops (``close``)
            raise
        finally:
            try:
                await frames.aclose()  # its generation cancelled, if it had not ended
            finally:
                self._ended(owner, key, state)

    def _journaled(self, owner: str, key: str, seq: int, batch: bytes, fed: Pieces | None) -> int | None:
        """A batch's events journaled from ``seq`` (``fed`` emptied into them) and its readers rung: the seq after
        them, or None if the stream is gone (deleted)."""
        events = [e + b"\n\n" for e in batch.split(b"\n\n") if e]
        if not self._write(owner, key, seq, events, fed):
            return None
        if fed:
            fed.clear()
        self._ring(owner, key)
        return seq + len(events)

    def _write(self, owner: str, key: str, seq: int, events: list[bytes], fed: Pieces | None) -> bool:
        """A batch's ``events``, numbered from ``seq``, and the pieces of text they were made of journaled; False,
        nothing written, if the stream is gone (deleted)."""
        with self._transaction() as db:
            if db.execute("SELECT 1 FROM streams WHERE owner = ? AND key = ?", (owner, key)).fetchone() is None:
                return False
            db.executemany("INSERT INTO events (owner, key, seq, data) VALUES (?, ?, ?, ?)",
                           [(owner, key, seq + i, e) for i, e in enumerate(events)])
            if fed:
                db.execute("INSERT INTO fed (owner, key, seq, pieces) VALUES (?, ?, ?, ?)",
                           (owner, key, seq, json.dumps(fed)))
        return True

    def _ended(self, owner: str, key: str, state: str) -> None:
        """The stream's end written, and the bytes it holds counted in the budget (room made: ``make_room``); its
        readers woken; whatever the file says, it is forgotten here."""
        try:
            now = time.time()
            with self._transaction() as db:
                if db.execute("UPDATE streams SET state = ?, ended = ? WHERE owner = ? AND key = ?",
                              (state, now, owner, key)).rowcount:
                    db.execute("INSERT OR REPLACE INTO sizes (owner, key, bytes, ended) VALUES (?, ?, ?, ?)",
                               (owner, key, _bytes(db, owner, key), now))
                    make_room(db, owner, self._budget)
        except sqlite3.Error as exc:
            log.error("the end of stream %r was not written (%s); its readers end as for a gateway that died", key,
                      exc)
        finally:
            self._ring(owner, key)
            self._wake.pop((owner, key), None)
            self._cancel.pop((owner, key), None)

    def take_over(self, owner: str, key: str) -> Taken | None:
        """Claim a running stream whose producing process died, for a new producer in this process: None if it is
        not (any more) such a stream, or it cannot be taken over (one asked to stop, a background response without
        its request, one journaled without the text of its events)."""
        with self._transaction() as db:
            row = db.execute("SELECT state, pid, head FROM streams WHERE owner = ? AND key = ?",
                             (owner, key)).fetchone()
            if row is None or row[0] != "running" or _alive(row[1]):
                return None
            request = db.execute("SELECT request FROM asked WHERE owner = ? AND key = ?", (owner, key)).fetchone()
            if row[2] is not None and request is None:
                return None
            last = db.execute("SELECT MAX(seq) FROM events WHERE owner = ? AND key = ?", (owner, key)).fetchone()
            batches = db.execute("SELECT seq, pieces FROM fed WHERE owner = ? AND key = ? ORDER BY seq",
                                 (owner, key)).fetchall()
            next_seq = 0 if last[0] is None else int(last[0]) + 1
            if next_seq and not batches:
                return None
            db.execute("UPDATE streams SET pid = ?, seen = ? WHERE owner = ? AND key = ?",
                       (os.getpid(), time.time(), owner, key))
        self._produced_here(owner, key)
        log.info("stream %r: its gateway process (pid %d) died; taken over here after %d events", key, row[1],
                 next_seq)
        return Taken(next_seq, [(int(i), str(t)) for _, pieces in batches for i, t in json.loads(pieces)], row[2],
                     request[0] if request is not None else None)

    def failed(self, owner: str, key: str, event: bytes, seq: int) -> None:
        """A stream taken over whose request cannot be sent again: ``event`` (the dialect's error) ends it."""
        with self._transaction() as db:
            db.execute("INSERT INTO events (owner, key, seq, data) VALUES (?, ?, ?, ?)", (owner, key, seq, event))
        self._ended(owner, key, "ended")

    def forget(self, owner: str, key: str) -> None:
        """A stream begun here that never started producing (its request was refused) taken back."""
        with self._transaction() as db:
            if db.execute("SELECT 1 FROM streams WHERE owner = ? AND key = ? AND pid = ?",
                          (owner, key, os.getpid())).fetchone():
                drop_stream(db, owner, key)
        self._wake.pop((owner, key), None)
        self._cancel.pop((owner, key), None)

    def delete(self, owner: str, key: str) -> bool:
        """Background response ``key`` of ``owner``'s gone from the journal (its events, its request, its row), and
        stopped if it runs; False if there is none."""
        with self._transaction() as db:
            gone = db.execute("SELECT 1 FROM streams WHERE owner = ? AND key = ? AND head IS NOT NULL",
                              (owner, key)).fetchone() is not None
            if gone:
                drop_stream(db, owner, key)
        event = self._cancel.get((owner, key))
        if gone and event is not None:
            event.set()
        self._ring(owner, key)
        return gone

    def cancel(self, owner: str, key: str) -> bool:
        """Stop a running stream, produced in this process or another; False if none of that key runs."""
        with self._lock:
            changed = self._db.execute("UPDATE streams SET state = 'cancelling' WHERE owner = ? AND key = ? AND "
                                       "state = 'running'", (owner, key)).rowcount
        event = self._cancel.get((owner, key))
        if event is not None:
            event.set()
        return bool(changed)

    def _ring(self, owner: str, key: str) -> None:
        bell = self._wake.get((owner, key))
        if bell is not None:
            bell.set()
            self._wake[owner, key] = asyncio.Event()

    def _look(self, owner: str, key: str) -> tuple[float, str]:
        """When a reader last looked at the stream, and its state."""
        with self._lock:
            row = self._db.execute("SELECT seen, state FROM streams WHERE owner = ? AND key = ?",
                                   (owner, key)).fetchone()
        return (float(row[0]), str(row[1])) if row else (0.0, "cancelling")

    # --- reading ---

    def stream(self, owner: str, key: str) -> Stream:
        """Stream ``key`` of ``owner``'s; ``NoStream`` if there is none."""
        with self._lock:
            row = self._db.execute("SELECT state, pid, digest, head FROM streams WHERE owner = ? AND key = ?",
                                   (owner, key)).fetchone()
        if row is None:
            raise NoStream(f"no stream with id {key!r:.80} to resume: it never started, ended more than "
                           f"{KEEP_S:g} s ago, or was another key's; send the request again without Last-Event-ID")
        stream = Stream(*row)
        if stream.state in ("running", "cancelling") and not _alive(stream.pid):
            return Stream("orphaned", stream.pid, stream.digest, stream.head)  # its gateway process died
        return stream

    async def tail(self, owner: str, key: str, after: int,
                   orphaned: Callable[[MpserveError, int], bytes]) -> AsyncGenerator[bytes, None]:
        """The stream's events after event ``after``, each with its ``id:``, as they come, to its end;
        ``orphaned(error, seq)``, the dialect's error event as event ``seq``, if its producer died before the end."""
        looked = 0.0
        while True:
            bell = self._wake.get((owner, key))
            now = time.time()
            with self._lock:
                if now - looked >= SEEN_EVERY_S:
                    self._db.execute("UPDATE streams SET seen = ? WHERE owner = ? AND key = ?", (now, owner, key))
                    looked = now
                rows = self._db.execute("SELECT seq, data FROM events WHERE owner = ? AND key = ? AND seq > ? "
                                        "ORDER BY seq", (owner, key, after)).fetchall()
                state = self._db.execute("SELECT state, pid FROM streams WHERE owner = ? AND key = ?",
                                         (owner, key)).fetchone()
            if rows:
                after = rows[-1][0]
                yield b"".join(b"id: %d\n" % seq + data for seq, data in rows)
                continue
            if state is not None and state[0] == "cancelled":
                yield orphaned(Cancelled("the stream was stopped before its end (cancelled, or no client read it "
                                         f"for {GRACE_S:g} s); the events above are all it made: send the request "
                                         "again"), after + 1)
                return
            if state is None or state[0] not in ("running", "cancelling"):
                return
            if not _alive(state[1]):
                yield orphaned(_orphaned(state[1]), after + 1)
                return
            if bell is None:
                await asyncio.sleep(POLL_S)
            else:
                with contextlib.suppress(asyncio.TimeoutError):
                    await within(bell.wait(), SEEN_EVERY_S)


async def _until(frames: AsyncGenerator[bytes, None], cancel: asyncio.Event, every: float
                 ) -> AsyncGenerator[bytes | None, None]:
    """``frames``' items until ``cancel`` is set, and None each time ``every`` seconds pass without one. Closed
    early, it leaves ``frames`` between items (its step cancelled), so that ``frames`` can be closed."""
    step: asyncio.Future[bytes] | None = None
    try:
        while not cancel.is_set():
            step = step or asyncio.ensure_future(anext(frames))
            stop = asyncio.ensure_future(cancel.wait())
            try:
                await asyncio.wait((step, stop), timeout=every, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
            if not step.done():
                if cancel.is_set():
                    return
                yield None
                continue
            done, step = step, None
            try:
                item = done.result()
            except StopAsyncIteration:
                return
            yield item
    finally:  # cancelled (the gateway stops), stopped, or closed by its reader: the step ends first
        if step is not None and not step.done():
            step.cancel()
            with contextlib.suppress(BaseException):
                await step


def _orphaned(pid: int) -> MpserveError:
    return ConnectionFailed(f"the gateway process that ran this stream (pid {pid}) died before its end; the events "
                            "above are all it made: send the request again")


def _alive(pid: int) -> bool:
    return pid == os.getpid() or pid_alive(pid)


def _forget_old(db: sqlite3.Connection, owner: str, now: float) -> None:
    """Streams ended more than KEEP_S ago dropped, and those whose gateway process died more than KEEP_S after
    they began; past MAX_STREAMS of ``owner``'s, its oldest ended ones."""
    old = db.execute("SELECT owner, key FROM streams WHERE state IN ('ended', 'cancelled') AND ended < ?",
                     (now - KEEP_S,)).fetchall()
    old += [(o, k) for o, k, pid in db.execute("SELECT owner, key, pid FROM streams WHERE state IN ('running', "
                                               "'cancelling') AND started < ?", (now - KEEP_S,)) if not _alive(pid)]
    extra = db.execute("SELECT owner, key FROM streams WHERE owner = ? AND state IN ('ended', 'cancelled') "
                       "ORDER BY started DESC LIMIT -1 OFFSET ?", (owner, MAX_STREAMS - 1)).fetchall()
    for gone in {*old, *extra}:
        drop_stream(db, *gone)


def _bytes(db: sqlite3.Connection, owner: str, key: str) -> int:
    """What the file keeps of a stream: its events, the text they were made of, its request and head."""
    parts = ("SELECT COALESCE(SUM(LENGTH(data)), 0) FROM events WHERE owner = ?1 AND key = ?2",
             "SELECT COALESCE(SUM(LENGTH(pieces)), 0) FROM fed WHERE owner = ?1 AND key = ?2",
             "SELECT COALESCE(SUM(LENGTH(request)), 0) FROM asked WHERE owner = ?1 AND key = ?2",
             "SELECT COALESCE(SUM(LENGTH(head)), 0) FROM streams WHERE owner = ?1 AND key = ?2")
    (total,) = db.execute("SELECT " + " + ".join(f"({part})" for part in parts), (owner, key)).fetchone()
    return int(total)
