"""The slot table: a shared-memory file of fixed-size rows, one per slot (a worker owns ``parallel``
consecutive slots). Readers in any process (the broker, ``mpserve status`` in another terminal) see
consistent rows without a round trip to the server.

Consistency is a per-row sequence lock: the writer makes the sequence odd, writes the fields, then makes
it even again; a reader retries while the sequence is odd or changed under it, and past a short wait (a writer
stalled or dead mid-update) takes the row as it last read it whole, saying for how long it has found that update
unfinished (``SlotRow.stuck_s``: the busy watchdog counts such a writer stalled, whatever its row last said); a row
found stuck is not waited for again until its writer moves on. Each row has exactly one
writer, the worker that owns it; the supervisor writes a row only before its worker starts and after it
has died (marking it dead), when that writer cannot be running. The supervisor alone creates and
unlinks the file.

The file lives in /dev/shm (a tmpfs) when there is one, so row updates are memory writes, not disk I/O.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

from mpserve.errors import BadRequest, ConfigError
from mpserve.private import create_private, open_private

MAGIC = b"MPSLOT06"
_HEADER = struct.Struct("<8sII")  # magic, rows, row size
_SEQ = struct.Struct("<Q")
# pid, worker, slot, state, device, model, request, tokens, served, started, progress, load_s, kv_cells, kv_capacity,
# then the host store as the instance sees it: RAM bytes, RAM capacity, hits, misses, evictions, disk bytes,
# disk capacity, skipped; then the LoRA adapters the slot's sequence runs under (``adapter_label``); then the host
# store's remote tier: hits, misses, errors, dropped writes
_FIELDS = struct.Struct("<iHHBxh48s40sIQdddIIQQIIIQQI40sIIII")
_CACHE = 14  # the first host-store field
_ADAPTERS = 22
_REMOTE = 23  # the first remote-tier field
ADAPTER_LABEL_BYTES = 40
STUCK_WRITER_S = 0.5  # a writer descheduled mid-update on a loaded host is waited for (a wait a tenth of this
# gave up on live writers on a busy small host); one that died mid-update holds up a reader of its row this long,
# until the row is written again
ROW_SIZE = 256  # room for fields to come; the magic changes with the layout
assert _SEQ.size + _FIELDS.size <= ROW_SIZE


class SlotState(IntEnum):
    EMPTY = 0
    STARTING = 1
    LOADING = 2
    IDLE = 3
    BUSY = 4
    STOPPING = 5
    DEAD = 6
    FAILED = 7
    UNLOADED = 8
    WAITING = 9  # has a request, waits for its GPU permit


@dataclass(frozen=True)
class CacheRow:
    """The host store as an instance's worker last wrote it (all 0: none, or not loaded): the tiers' bytes are
    the host's, the counts this instance's."""

    bytes: int  # in the RAM tier
    capacity: int
    hits: int
    misses: int
    evictions: int
    disk_bytes: int = 0
    disk_capacity: int = 0
    skipped: int = 0  # bad entries removed, writes not made (a full disk)
    remote_hits: int = 0  # the remote tier (cache_remote), as the instance used it
    remote_misses: int = 0
    remote_errors: int = 0  # calls that failed: Redis down, slow or refusing
    remote_dropped: int = 0  # writes not made: the queue was full, or Redis was down

    @classmethod
    def empty(cls) -> CacheRow:
        return cls(0, 0, 0, 0, 0)


@dataclass(frozen=True)
class SlotRow:
    index: int
    pid: int
    worker: int
    slot: int
    state: SlotState
    device: int  # -1: CPU
    model: str
    request: str
    tokens: int  # generated for the current (or last) request
    served: int  # requests finished by this slot since its worker started
    started: float  # unix time the worker process started
    progress: float  # unix time of the last state change or generated token
    load_s: float  # seconds the model took to load
    kv_cells: int  # KV cells the slot holds now: its running sequence's, or what its last request left
    kv_capacity: int  # KV cells the slot may hold (n_ctx)
    cache: CacheRow  # the host store as its instance sees it (the same in each of the instance's rows)
    adapters: str = ""  # the LoRA adapters its running (or last) sequence runs under (``adapter_label``); "": none
    stuck_s: float = 0.0  # how long this reader has found its writer in the middle of one update (0: read whole)


def adapter_label(adapters: tuple[tuple[str, float], ...]) -> str:
    """A sequence's adapters as its slot row shows them: names sorted, each with ``*scale`` unless 1, joined by
    ``+`` ("a+b*0.5"); "" for none. Past ADAPTER_LABEL_BYTES it is cut, ending in "~" (adapter names are ASCII)."""
    label = "+".join(name if scale == 1.0 else f"{name}*{scale:g}" for name, scale in sorted(adapters) if scale)
    return label if len(label) <= ADAPTER_LABEL_BYTES else label[:ADAPTER_LABEL_BYTES - 1] + "~"


BASE_LABEL = "base"  # the base model in a list of adapter sets


def active_sets(slots: Sequence[SlotRow]) -> list[str]:
    """The adapter sets an instance's running sequences use (``adapter_label``s, the base model as BASE_LABEL),
    sorted; [] when none runs."""
    return sorted({r.adapters or BASE_LABEL for r in slots if r.state in (SlotState.BUSY, SlotState.WAITING)})


def instance_slots(rows: list[SlotRow]) -> dict[tuple[str, int], list[SlotRow]]:
    """The rows of each started instance, by (model, worker index), in table order."""
    instances: dict[tuple[str, int], list[SlotRow]] = {}
    for row in rows:
        if row.state is not SlotState.EMPTY:
            instances.setdefault((row.model, row.worker), []).append(row)
    return instances


def locate(rows: list[SlotRow], index: int) -> tuple[str, int]:
    """Slot-table row ``index`` (SLOT in ``mpserve status``) as its instance's identity and its slot there."""
    if not 0 <= index < len(rows) or rows[index].state is SlotState.EMPTY:
        raise BadRequest(f"no slot {index}; `mpserve status` lists the slots")
    return f"w{rows[index].worker}", rows[index].slot


def shm_dir() -> Path:
    return Path("/dev/shm") if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else Path(
        os.environ.get("TMPDIR", "/tmp"))


class SlotTable:
    """A mapped slot-table file. ``create`` (supervisor) or ``attach`` (everyone else)."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, rows: int, owner: bool) -> None:
        self.path = path
        self._fd = fd
        self._mm = mm
        self.rows = rows
        self._owner = owner
        self._last: dict[int, tuple[Any, ...]] = {}  # each row's fields as this table last read them whole
        self._stuck: dict[int, tuple[int, float]] = {}  # rows found mid-update past the wait: (sequence, since)

    @classmethod
    def create(cls, path: Path, rows: int) -> SlotTable:
        """A new table at ``path`` (0600, never through a link), which the caller cleared of a dead server's."""
        size = _HEADER.size + rows * ROW_SIZE
        try:
            fd = create_private(path)
        except FileExistsError:
            raise ConfigError(f"the slot table {path} appeared after it was cleared: another process makes files "
                              f"under this name; stop it, or give this server another --server-name") from None
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        _HEADER.pack_into(mm, 0, MAGIC, rows, ROW_SIZE)
        return cls(path, fd, mm, rows, owner=True)

    @classmethod
    def attach(cls, path: Path, writable: bool = True) -> SlotTable:
        """The table at ``path``, only as a regular file of this user's, never through a link (an instance adopted
        by a new server attaches the one that server made: ``mpserve.server.adoption``)."""
        fd = open_private(path, os.O_RDWR if writable else os.O_RDONLY)
        size = os.fstat(fd).st_size
        if size < _HEADER.size:
            os.close(fd)
            raise ValueError(f"{path} is not a slot table (too short)")
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        magic, rows, row_size = _HEADER.unpack_from(mm, 0)
        if magic != MAGIC or row_size != ROW_SIZE or size < _HEADER.size + rows * ROW_SIZE:
            mm.close()
            os.close(fd)
            raise ValueError(f"{path} is not a slot table of this version of mpserve")
        return cls(path, fd, mm, rows, owner=False)

    @classmethod
    def read_rows(cls, path: Path) -> list[SlotRow]:
        """Every row of the table at ``path`` as it is now: attached read-only, read whole once, let go."""
        table = cls.attach(path, writable=False)
        try:
            return table.read_all()
        finally:
            table.close()

    def writer(self, index: int, like: SlotWriter | None = None) -> SlotWriter:
        """The writer of row ``index``; ``like``: another table's writer whose fields it takes, and writes at once
        (an adopted instance's rows, moved into its new server's table)."""
        if not 0 <= index < self.rows:
            raise IndexError(f"slot {index} out of range 0..{self.rows - 1}")
        writer = SlotWriter(self._mm, _HEADER.size + index * ROW_SIZE)
        if like is not None:
            writer._values = list(like._values)
            writer._write()
        return writer

    def read(self, index: int) -> SlotRow:
        offset = _HEADER.size + index * ROW_SIZE
        deadline = stuck_s = 0.0
        while True:
            (seq,) = _SEQ.unpack_from(self._mm, offset)
            fields = _FIELDS.unpack_from(self._mm, offset + _SEQ.size)
            if not seq & 1 and _SEQ.unpack_from(self._mm, offset)[0] == seq:
                self._last[index] = fields
                self._stuck.pop(index, None)
                break
            # A writer is mid-update: let it finish. One descheduled on a loaded host, or stopped, or dead
            # mid-update (its row stays so until the supervisor rewrites it) holds the sequence odd: after a
            # short wait (none if this update was found stuck before) the row is what this table last read of
            # it whole, or, never read whole, as it is.
            now = time.monotonic()
            deadline = deadline or now + STUCK_WRITER_S
            stuck_s = self._stuck_for(index, seq, now, now > deadline)
            if stuck_s:
                fields = self._last.get(index, fields)
                break
            time.sleep(0)
        pid, worker, slot, state, device, model, request, tokens, served, started, progress, load_s, kv_cells, \
            kv_capacity = fields[:_CACHE]
        return SlotRow(index, pid, worker, slot, SlotState(state), device, _text(model), _text(request),
                       tokens, served, started, progress, load_s, kv_cells, kv_capacity,
                       CacheRow(*fields[_CACHE:_ADAPTERS], *fields[_REMOTE:]), _text(fields[_ADAPTERS]), stuck_s)

    def _stuck_for(self, index: int, seq: int, now: float, waited: bool) -> float:
        """How long row ``index``'s writer has been found in the middle of update ``seq`` (0.0: not found stuck,
        wait on): since this table first gave up waiting for that update, counting the wait."""
        known = self._stuck.get(index)
        if known is not None and known[0] == seq:
            return max(now - known[1], STUCK_WRITER_S)
        if not waited:
            return 0.0
        self._stuck[index] = (seq, now - STUCK_WRITER_S)
        return STUCK_WRITER_S

    def read_all(self) -> list[SlotRow]:
        return [self.read(i) for i in range(self.rows)]

    def close(self) -> None:
        self._mm.close()
        os.close(self._fd)

    def unlink(self) -> None:
        """Remove the file (supervisor only). Mapped readers keep working until they close."""
        if self._owner:
            self.path.unlink(missing_ok=True)


class SlotWriter:
    """The single writer of one row. Keeps the row's fields so each update writes them all at once."""

    def __init__(self, mm: mmap.mmap, offset: int) -> None:
        self._mm = mm
        self._offset = offset
        self._values = list(_FIELDS.unpack_from(mm, offset + _SEQ.size))

    def update(self, *, pid: int | None = None, worker: int | None = None, slot: int | None = None,
               state: SlotState | None = None, device: int | None = None, model: str | None = None,
               request: str | None = None, tokens: int | None = None, served: int | None = None,
               started: float | None = None, load_s: float | None = None, kv_cells: int | None = None,
               kv_capacity: int | None = None, adapters: str | None = None) -> None:
        v = self._values
        for i, value in enumerate((pid, worker, slot, state, device)):
            if value is not None:
                v[i] = int(value)
        if model is not None:
            v[5] = model.encode()[:48]
        if request is not None:
            v[6] = request.encode()[:40]
        if tokens is not None:
            v[7] = tokens
        if served is not None:
            v[8] = served
        if started is not None:
            v[9] = started
        v[10] = time.time()
        if load_s is not None:
            v[11] = load_s
        if kv_cells is not None:
            v[12] = kv_cells
        if kv_capacity is not None:
            v[13] = kv_capacity
        if adapters is not None:
            v[_ADAPTERS] = adapters.encode()[:ADAPTER_LABEL_BYTES]
        self._write()

    def _write(self) -> None:
        (seq,) = _SEQ.unpack_from(self._mm, self._offset)
        seq |= 1
        _SEQ.pack_into(self._mm, self._offset, seq)
        _FIELDS.pack_into(self._mm, self._offset + _SEQ.size, *self._values)
        _SEQ.pack_into(self._mm, self._offset, seq + 1)

    def cache(self, cache: CacheRow) -> None:
        """The host store as the instance sees it; not progress (the watchdog's clock is left alone)."""
        self._values[_CACHE:_ADAPTERS] = [cache.bytes, cache.capacity, cache.hits, cache.misses, cache.evictions,
                                 cache.disk_bytes, cache.disk_capacity, cache.skipped]
        self._values[_REMOTE:] = [cache.remote_hits, cache.remote_misses, cache.remote_errors, cache.remote_dropped]
        self._write()

    def progress(self, tokens: int, kv_cells: int) -> None:
        """The hot path: one generated token."""
        self.update(tokens=tokens, kv_cells=kv_cells)


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode(errors="replace")
