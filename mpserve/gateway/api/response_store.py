"""The Responses API's stored responses, in one SQLite file that every gateway process of a port shares.

    put(owner, response, conversation) ──▶ one transaction (BEGIN IMMEDIATE: writers take turns, across
                                           processes): the row replaced; then ``make_room``
    make_room(db, owner, budget)         ──▶ (also at the end of a journaled stream: ``journal``) past
                                           ``budget.per_key`` bytes of that owner's, then past ``budget.total``
                                           of anyone's: ended journaled streams dropped, oldest first, then
                                           stored responses, oldest first
    get(owner, id) / delete(owner, id) ──▶ that owner's row only (an owner: ``dialect.owner``, the caller's key);
                                           a background response's delete leaves a mark for DELETED_KEEP_S under
                                           which no put stores the id again (one ending meanwhile, in any process)

The file is ``$RUNTIME/NAME.responses-PORT.sqlite`` (``path_for``): in the runtime folder, which is this user's
alone (0700), created 0600 and never through a link. Several gateway processes on one port (``--http-workers``)
see one store, so a response stored through one is found through any; one that restarts finds them too, and so
does the next start of a server that was killed or upgraded. A clean stop removes it (``remove``). Each
row holds the response's object and its conversation (chat messages, its own output last) as their JSON text,
so what is counted is what is held. A response larger than a key's budget is not kept. The journal of resumable
streams (``journal``) is in the same file, and in the same budget: an ended stream's events, the text they were
made of and its request count from its end (``sizes``), and go before any stored response does; a running stream
is never cut.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpserve.errors import BadRequest, ConfigError
from mpserve.private import PlantedFile, check_private, create_private
from mpserve.runtime import runtime_dir

STORE_BYTES = 256 * 1024 * 1024
"""Bytes of stored responses and ended journaled streams in all (--responses-store); past it, the oldest stream of
any key goes first, then the oldest response."""
STORE_BYTES_PER_KEY = 32 * 1024 * 1024
"""Bytes of stored responses and ended journaled streams per API key (--responses-store-per-key); past it, that
key's oldest stream goes first, then its oldest response."""
BUSY_TIMEOUT_MS = 5000  # how long a process waits for another's write
DELETED_KEEP_S = 3600.0  # how long a deleted response's id is refused a put

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- the order they were stored in: the oldest go first
    owner TEXT NOT NULL,
    id TEXT NOT NULL,
    data BLOB NOT NULL,
    UNIQUE (owner, id)
);
CREATE INDEX IF NOT EXISTS by_owner ON responses (owner, seq);
CREATE TABLE IF NOT EXISTS sizes (  -- ended journaled streams (``journal``): the bytes they hold, in the budget
    owner TEXT NOT NULL,
    key TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    ended REAL NOT NULL,              -- wall clock (seconds since the epoch): the oldest go first
    PRIMARY KEY (owner, key)
);
CREATE TABLE IF NOT EXISTS deleted (  -- ids deleted: a put of one is refused (a background response that ended late)
    owner TEXT NOT NULL,
    id TEXT NOT NULL,
    at REAL NOT NULL,                   -- wall clock (seconds since the epoch)
    PRIMARY KEY (owner, id)
);
"""

Stored = tuple[dict[str, Any], list[dict[str, Any]]]  # a response, and its conversation as chat messages


@dataclass(frozen=True)
class StoreBudget:
    total: int = STORE_BYTES
    per_key: int = STORE_BYTES_PER_KEY


class NotStored(BadRequest):
    """A response id that is not (or no longer) stored for the caller's key."""


def path_for(server_name: str, port: int) -> Path:
    return runtime_dir() / f"{server_name}.responses-{port}.sqlite"


def remove(path: Path) -> None:
    """The store's file and SQLite's files beside it removed, once no gateway process of its port runs: a clean
    stop (``fleet.Fleet.stop``, or a lone gateway's end) leaves no responses in the runtime folder."""
    for name in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        name.unlink(missing_ok=True)


class ResponseStore:
    """Stored responses by owner, within ``budget``, in the SQLite file at ``path``."""

    def __init__(self, path: Path, budget: StoreBudget = StoreBudget()) -> None:
        self.budget = budget
        self.path = path
        self._db = open_db(path, SCHEMA)
        self._lock = threading.Lock()  # one connection, used by the event loop and threads alike

    def put(self, owner: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        data = json.dumps([response, conversation], ensure_ascii=False, separators=(",", ":")).encode()
        with self._lock, self._transaction() as db:
            db.execute("DELETE FROM responses WHERE owner = ? AND id = ?", (owner, response["id"]))
            if len(data) > self.budget.per_key or db.execute(
                    "SELECT 1 FROM deleted WHERE owner = ? AND id = ?", (owner, response["id"])).fetchone():
                return
            db.execute("INSERT INTO responses (owner, id, data) VALUES (?, ?, ?)", (owner, response["id"], data))
            make_room(db, owner, self.budget)

    def get(self, owner: str, response_id: str) -> Stored:
        with self._lock:
            row = self._db.execute("SELECT data FROM responses WHERE owner = ? AND id = ?",
                                   (owner, response_id)).fetchone()
        if row is None:
            raise self.not_stored(response_id)
        response, conversation = json.loads(row[0])
        return response, conversation

    def delete(self, owner: str, response_id: str, journaled: bool = False) -> None:
        """The response dropped; NotStored if there was none and it was not ``journaled`` (a background response
        whose journal was just deleted: it could end and be put meanwhile, so a put of its id is refused from now)."""
        now = time.time()
        with self._lock, self._transaction() as db:
            db.execute("DELETE FROM deleted WHERE at < ?", (now - DELETED_KEEP_S,))
            gone = db.execute("DELETE FROM responses WHERE owner = ? AND id = ?", (owner, response_id)).rowcount
            if journaled:
                db.execute("INSERT OR REPLACE INTO deleted (owner, id, at) VALUES (?, ?, ?)", (owner, response_id, now))
        if not gone and not journaled:
            raise self.not_stored(response_id)

    def not_stored(self, response_id: str) -> NotStored:
        return NotStored(f"no stored response with id {response_id!r:.80} (responses are kept by the gateway, at "
                         f"most {self.budget.per_key} bytes of them per API key and {self.budget.total} in all, the "
                         "oldest dropped first; send store: true to keep one)")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _transaction(self) -> _Immediate:
        return _Immediate(self._db)


class _Immediate:
    """``BEGIN IMMEDIATE`` … ``COMMIT`` (``ROLLBACK`` on an exception): the write lock taken at the start, so two
    processes' budgets never interleave."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> sqlite3.Connection:
        self._db.execute("BEGIN IMMEDIATE")
        return self._db

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self._db.execute("ROLLBACK" if exc_type is not None else "COMMIT")


STREAM_TABLES = ("events", "fed", "asked", "sizes", "streams")
"""Where a journaled stream is kept (``journal``), its row last."""


def drop_stream(db: sqlite3.Connection, owner: str, key: str) -> None:
    """Everything the file keeps of journaled stream ``key`` of ``owner``'s."""
    for table in STREAM_TABLES:
        db.execute(f"DELETE FROM {table} WHERE owner = ? AND key = ?", (owner, key))  # noqa: S608 - a table of ours


def make_room(db: sqlite3.Connection, owner: str, budget: StoreBudget) -> None:
    """``owner``'s bytes brought within ``budget.per_key``, then everyone's within ``budget.total``."""
    _drop_oldest(db, "WHERE owner = ?", (owner,), budget.per_key)
    _drop_oldest(db, "", (), budget.total)


def _drop_oldest(db: sqlite3.Connection, where: str, args: tuple[str, ...], budget: int) -> None:
    """Of the bytes of ``where`` (stored responses, ended journaled streams), ended streams dropped, oldest first,
    then responses, oldest first, until they are within ``budget``."""
    (stored,) = db.execute(f"SELECT COALESCE(SUM(LENGTH(data)), 0) FROM responses {where}", args).fetchone()
    (journaled,) = db.execute(f"SELECT COALESCE(SUM(bytes), 0) FROM sizes {where}", args).fetchone()
    held = stored + journaled
    if held <= budget:
        return
    for stream_owner, key, size in db.execute(f"SELECT owner, key, bytes FROM sizes {where} ORDER BY ended",
                                              args).fetchall():
        if held <= budget:
            return
        drop_stream(db, stream_owner, key)
        held -= size
    rows = db.execute(f"SELECT seq, LENGTH(data) FROM responses {where} ORDER BY seq", args)
    doomed = []
    for seq, size in rows:
        if held <= budget:
            break
        doomed.append((seq,))
        held -= size
    db.executemany("DELETE FROM responses WHERE seq = ?", doomed)


def open_db(path: Path, schema: str) -> sqlite3.Connection:
    """A connection to the gateway's SQLite file at ``path`` (checked or created private first), its tables made:
    autocommit, write-ahead log (readers never wait for a writer), usable from any thread (its user holds a lock)."""
    _check_file(path)
    db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(schema)
    return db


def _check_file(path: Path) -> None:
    """The store's file created 0600 if missing; refused (``ConfigError``) if its name is a link, another user's
    file or not a file. An existing one is checked without opening it: this process may hold it open already (the
    journal and the store each connect), and closing a descriptor of it would drop that connection's locks, which
    tell the other processes' SQLite that it is in use (one closing last would then delete the write-ahead log
    under the others)."""
    try:
        check_private(path)
        return
    except FileNotFoundError:
        pass
    except (PlantedFile, OSError) as exc:
        raise ConfigError(f"cannot use the stored responses' file {path} ({exc.strerror or exc}); remove it "
                          f"(rm {path})") from None
    try:
        os.close(create_private(path))
    except FileExistsError:  # another gateway process created it meanwhile
        _check_file(path)
    except OSError as exc:
        raise ConfigError(f"cannot create the stored responses' file {path} ({exc.strerror}); set "
                          "MPSERVE_RUNTIME_DIR to a folder you can write") from None
