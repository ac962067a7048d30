"""Host-wide, crash-safe counting permits per GPU.

A ``DevicePermits(key, capacity)`` lets at most ``capacity`` holders use one device at once, across
every process of this user on the host, separate servers included. A holder that dies, even by
SIGKILL, gives its permit back at once and with nobody's help.

The lock folder and its files are this user's alone (``mpserve.private``): the folder 0700 and
refused if another user owns it or others may enter it, a file 0600, made whole under a temporary
name and linked into place, opened without following a link, and used only with this layout's size
and header (a planted file or link is refused, never truncated or rewritten). Another user's servers
thus never share, lock up or overwrite this user's permits.

Why open-file-description byte-range locks
------------------------------------------
- A POSIX or System V semaphore keeps its count in memory that nobody repairs: a holder killed
  between wait and post leaves the count one short for ever (SEM_UNDO exists only for System V and
  is not reachable from the standard library).
- Classic ``fcntl`` record locks (F_SETLK) belong to the process: closing *any* descriptor of the
  file drops all of that process's locks on it, and two threads of one process never exclude
  each other.
- OFD locks (F_OFD_SETLK, Linux 3.15+) belong to an open file description: the kernel drops them
  when the last descriptor of that description is closed, which includes the process dying. Each
  ``acquire`` uses its own description, so threads of one process exclude each other too.

The lock file ``<lock_dir>/<key>.lock`` has one lock byte per permit slot; holding slot ``i`` means
holding a write lock on its byte. Safety (never more than ``capacity`` holders) rests on these
kernel locks alone. Everything else in the file is a best-effort record that a dead process may
leave behind; every record is trusted only while its lock byte is held, so stale records are
ignored and nothing a dead process leaves can wedge the others.

Fairness: a ticket queue
------------------------
A waiter first takes a *queue place* (another lock byte, one of ``QUEUE_PLACES``), then, under a
short ticket lock, draws the next ticket number and writes ``(pid, ticket, since)`` in the place's
record. It may take a free permit slot only when no live place holds an earlier ticket. A waiter
that dies or times out frees its place, so the one behind it moves up. Waiters are thus served in
arrival order; only past ``QUEUE_PLACES`` simultaneous waiters on one device do the extra ones
wait for a place unordered.

Waiting polls with a short backoff instead of sleeping in F_OFD_SETLKW: a blocking lock call
cannot be given a timeout from Python, nor wait for any one of several bytes. The first waiter in
line polls from ``_FIRST_POLL``, doubling up to ``_HEAD_POLL``; the others only watch for their turn, up
to ``_QUEUE_POLL``. A permit thus passes to the next holder within about one head poll, small beside a
model request (``python -m bench.permits_bench`` measures the hand-off), while a waiter's polls cost only
a small share of a core.

Capacity: stored in the file, mismatches refused
------------------------------------------------
Every open ``DevicePermits`` holds a shared lock on a "users" byte. The first user (the only one
that can take that byte exclusively) writes its capacity into the header; later users must ask for
the same capacity, else they get a ``ConfigError``. Silently trusting each caller's capacity would
let a server configured "exclusive" share its GPU with one configured for two; refusing tells the
operator at start-up. ``capacity=None`` (unlimited) takes part in this check but records nothing.

File layout (4 KiB, read and written through a shared mmap)::

    0      header: magic, layout version, capacity (0 = unlimited), next ticket
    64     holder columns, one entry per permit slot: pid, since
    1088   waiter columns, one entry per queue place: pid, ticket, since

The lock bytes sit at offsets past the data (locks are advisory and never touch it)::

    LOCK_BASE + 0        INIT: held exclusively while a user opens the file and checks the header
    LOCK_BASE + 1        USERS: shared by every open DevicePermits
    LOCK_BASE + 2        TICKET: held while a waiter draws a ticket
    PERMIT_BASE + i      permit slot i
    QUEUE_BASE + j       queue place j

Each acquire's description is opened through ``/proc/self/fd`` from the first one, never by the path
again. Descriptors are opened close-on-exec, and a process forked from a user closes its copies at once
(``os.register_at_fork``): a forked child keeping a copy would otherwise keep the parent's locks
alive after the parent died.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import re
import struct
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from mpserve.errors import Cancelled, ConfigError, Timeout
from mpserve.private import PlantedFile, check_private_dir, create_private, open_private, private_dir

MAX_CAPACITY = 64
QUEUE_PLACES = 64

_MAGIC = b"mpsperm\0"
_LAYOUT_VERSION = 1
_HEADER = struct.Struct("<8sIIQ")  # magic, version, capacity, next ticket
_TICKET_OFFSET = 16
_HOLDERS = 64
_WAITERS = _HOLDERS + 2 * 8 * MAX_CAPACITY
_FILE_SIZE = 4096

_LOCK_BASE = 1 << 20
_INIT_BYTE = _LOCK_BASE
_USERS_BYTE = _LOCK_BASE + 1
_TICKET_BYTE = _LOCK_BASE + 2
_PERMIT_BASE = _LOCK_BASE + 64
_QUEUE_BASE = _PERMIT_BASE + MAX_CAPACITY

_FIRST_POLL = 50e-6
_HEAD_POLL = 500e-6  # the first waiter in line: it is the one whose wait idles the device
_QUEUE_POLL = 1e-3  # the others only watch for their turn to come

LOCK_FOLDER = "permit lock folder"
_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class PermitHolder:
    """A live holder as seen from any process; ``pid`` is None in the microseconds before it is written."""

    slot: int
    pid: int | None
    since: float  # wall clock (time.time), for display


@dataclass(frozen=True)
class PermitWaiter:
    pid: int
    ticket: int
    since: float  # wall clock (time.time)


@dataclass(frozen=True)
class HoldInterval:
    """One hold, timed with time.monotonic (one clock for all processes of a host).

    ``start`` is taken after the lock is held and ``end`` before it is released, so the intervals
    of holders that exclude each other never overlap.
    """

    device_key: str
    pid: int
    slot: int | None
    start: float
    end: float


class Permit:
    """One held permit; a context manager. ``release`` may be called more than once."""

    def __init__(self, owner: DevicePermits, fd: int | None, slot: int | None, start: float) -> None:
        self._owner = owner
        self._fd = fd
        self.slot = slot
        self.start = start
        self._released = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._owner._release(self, self._fd)

    def __enter__(self) -> Permit:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class DevicePermits:
    """The permits of one device, shared by every process that opens the same key in the same lock_dir."""

    def __init__(
        self,
        device_key: str,
        capacity: int | None,
        lock_dir: Path | None = None,
        on_hold: Callable[[HoldInterval], None] | None = None,
    ) -> None:
        if not _KEY.fullmatch(device_key):
            raise ConfigError(f"device key {device_key!r} must be letters, digits, '.', '_' or '-'")
        if capacity is not None and not 1 <= capacity <= MAX_CAPACITY:
            raise ConfigError(f"permit capacity {capacity} is outside 1..{MAX_CAPACITY} (or None: unlimited)")
        self.device_key = device_key
        self.capacity = capacity
        self.path = _lock_folder(lock_dir) / f"{device_key}.lock"
        self._on_hold = on_hold
        self._pid = os.getpid()
        self._guard = threading.Lock()
        self._fds: set[int] = set()  # every pooled descriptor, idle or in use
        self._idle_fds: list[int] = []
        self._held: set[Permit] = set()
        self._closed = False
        with ExitStack() as undo:
            self._inspect_fd = _open_lock_file(self.path)
            undo.callback(os.close, self._inspect_fd)
            self._records = _Records(self._inspect_fd)
            undo.callback(self._records.close)
            self._join()
            undo.pop_all()
        _OPEN.add(self)

    def acquire(self, timeout: float | None = None, stop: Callable[[], bool] | None = None) -> Permit:
        """Wait for a permit, in arrival order; ``Timeout`` after ``timeout`` seconds (None: for ever).

        ``stop`` is asked between polls; once it answers True the wait ends with ``Cancelled`` (a worker
        whose request is cancelled while it queues for the GPU)."""
        self._check_open()
        if self.capacity is None:
            return Permit(self, None, None, time.monotonic())
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self._take_fd()
        try:
            slot = self._queue_for_slot(fd, deadline, stop or _never)
        except BaseException:
            self._discard_fd(fd)  # closing the description drops whatever it may still hold
            raise
        if slot is None:
            self._give_back_fd(fd)
            if stop is not None and stop():
                raise Cancelled(f"stopped while waiting for a permit of device {self.device_key}")
            assert timeout is not None  # only a deadline or stop ends the wait without a slot
            raise self._timeout(timeout)
        permit = Permit(self, fd, slot, time.monotonic())
        with self._guard:
            self._held.add(permit)
        return permit

    def holders(self) -> list[PermitHolder]:
        self._check_open()
        return _holders(self._inspect_fd, self._records, self.capacity or 0)

    def waiters(self) -> list[PermitWaiter]:
        self._check_open()
        return _waiters(self._inspect_fd, self._records)

    def close(self) -> None:
        """Release the permits this object still holds and leave the device; not while acquires run."""
        if self._closed:
            return
        for permit in list(self._held):
            permit.release()
        self._closed = True
        _OPEN.discard(self)
        for fd in self._idle_fds:
            os.close(fd)
        self._fds.clear()
        self._idle_fds.clear()
        self._records.close()
        os.close(self._inspect_fd)

    def __enter__(self) -> DevicePermits:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- joining: one capacity per device --------------------------------------------------------

    def _join(self) -> None:
        fd = self._inspect_fd
        _lock(fd, _INIT_BYTE, wait=True)
        try:
            wanted = self.capacity or 0
            stored = self._records.stored_capacity()
            if stored == wanted:
                _lock(fd, _USERS_BYTE, shared=True, wait=True)  # only a joiner holding INIT excludes it
            elif _lock(fd, _USERS_BYTE):
                self._records.reset(wanted)
                _lock(fd, _USERS_BYTE, shared=True)  # downgrade in place: others may join now
            else:
                raise ConfigError(
                    f"device {self.device_key} is in use with permit capacity {_describe(stored)} "
                    f"(lock file {self.path}); this server asks for {_describe(wanted)}. All servers "
                    "on a host must agree on a device's capacity: change the config or stop the others"
                )
        finally:
            _unlock(fd, _INIT_BYTE)

    # -- acquiring: queue place, ticket, slot ----------------------------------------------------

    def _queue_for_slot(self, fd: int, deadline: float | None, stop: Callable[[], bool]) -> int | None:
        """The permit slot now held through ``fd``, or None at the deadline or once ``stop()``."""
        place = self._take_place(fd, deadline, stop)
        if place is None:
            return None
        records = self._records
        try:
            _lock(fd, _TICKET_BYTE, wait=True)
            try:
                ticket = records.draw_ticket()
                records.waiter_pid[place] = self._pid
                records.waiter_since[place] = time.time()
                records.waiter_ticket[place] = ticket
            finally:
                _unlock(fd, _TICKET_BYTE)
            delay = _FIRST_POLL
            first_in_line = False
            while True:
                # once first, always first: every earlier ticket's record was written before ours was drawn
                first_in_line = first_in_line or not self._earlier_waiter_alive(fd, ticket)
                if first_in_line:
                    slot = self._take_free_slot(fd)
                    if slot is not None:
                        records.holder_pid[slot] = self._pid
                        records.holder_since[slot] = time.time()
                        return slot
                if stop() or not _nap(deadline, delay):
                    return None
                delay = min(2 * delay, _HEAD_POLL if first_in_line else _QUEUE_POLL)
        finally:
            records.waiter_ticket[place] = 0
            _unlock(fd, _QUEUE_BASE + place)

    def _take_place(self, fd: int, deadline: float | None, stop: Callable[[], bool]) -> int | None:
        delay = _FIRST_POLL
        while True:
            for place in range(QUEUE_PLACES):
                if _lock(fd, _QUEUE_BASE + place):
                    return place
            if stop() or not _nap(deadline, delay):
                return None
            delay = min(2 * delay, _QUEUE_POLL)

    def _earlier_waiter_alive(self, fd: int, ticket: int) -> bool:
        return any(
            0 < other < ticket and _is_locked(fd, _QUEUE_BASE + place)
            for place, other in enumerate(self._records.waiter_ticket.tolist())
        )

    def _take_free_slot(self, fd: int) -> int | None:
        assert self.capacity is not None
        for slot in range(self.capacity):
            if _lock(fd, _PERMIT_BASE + slot):
                return slot
        return None

    def _timeout(self, timeout: float) -> Timeout:
        return Timeout(
            f"no permit for device {self.device_key} within {timeout:g} s "
            f"({len(self.holders())} of {self.capacity} held, {len(self.waiters())} waiting)"
        )

    # -- releasing -------------------------------------------------------------------------------

    def _release(self, permit: Permit, fd: int | None) -> None:
        end = time.monotonic()
        with self._guard:
            if self._closed:
                return  # only after a fork: the child must not unlock what the parent holds
            self._held.discard(permit)
        if fd is not None and permit.slot is not None:
            self._records.holder_pid[permit.slot] = 0
            _unlock(fd, _PERMIT_BASE + permit.slot)
            self._give_back_fd(fd)
        if self._on_hold is not None:
            self._on_hold(HoldInterval(self.device_key, self._pid, permit.slot, permit.start, end))

    # -- descriptors: one open file description per concurrent acquire ---------------------------

    def _take_fd(self) -> int:
        with self._guard:
            if self._idle_fds:
                return self._idle_fds.pop()
            fd = _reopen(self._inspect_fd)
            self._fds.add(fd)
            return fd

    def _give_back_fd(self, fd: int) -> None:
        with self._guard:
            if not self._closed:
                self._idle_fds.append(fd)
                return
        self._discard_fd(fd)

    def _discard_fd(self, fd: int) -> None:
        with self._guard:
            self._fds.discard(fd)
        os.close(fd)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError(f"permits of device {self.device_key} are closed")

    def _forget_after_fork(self) -> None:
        """In a forked child: close the inherited descriptors, never unlock: the locks are the parent's."""
        self._closed = True
        for fd in [*self._fds, self._inspect_fd]:
            os.close(fd)
        self._fds.clear()
        self._idle_fds.clear()
        self._held.clear()


@dataclass(frozen=True)
class PermitState:
    """What ``inspect`` sees of a device's permits from outside (``mpserve devices``)."""

    capacity: int | None  # None: unlimited
    holders: list[PermitHolder]
    waiters: list[PermitWaiter]


def inspect(device_key: str, lock_dir: Path | None = None) -> PermitState | None:
    """The holders and waiters of a device's permits, without joining them; None if nobody has used the
    device's permits since the lock file was made (or no server uses permits, or the file is not one of ours)."""
    path = _lock_folder(lock_dir) / f"{device_key}.lock"
    try:
        fd = open_private(path, os.O_RDWR)
    except OSError:  # none, or not one of ours: no server of this user uses the device's permits
        return None
    try:
        if _lock_file_problem(fd) or not _is_locked(fd, _USERS_BYTE):
            return None
        records = _Records(fd)
        try:
            capacity = records.stored_capacity() or None
            return PermitState(capacity, _holders(fd, records, capacity or 0), _waiters(fd, records))
        finally:
            records.close()
    finally:
        os.close(fd)


def _holders(fd: int, records: _Records, capacity: int) -> list[PermitHolder]:
    """Slots whose lock byte is held (by a description other than ``fd``'s), with their records."""
    return [
        PermitHolder(slot, records.holder_pid[slot] or None, records.holder_since[slot])
        for slot in range(capacity)
        if _is_locked(fd, _PERMIT_BASE + slot)
    ]


def _waiters(fd: int, records: _Records) -> list[PermitWaiter]:
    """Live queue places, in ticket (arrival) order."""
    waiting = [
        PermitWaiter(records.waiter_pid[place], ticket, records.waiter_since[place])
        for place, ticket in enumerate(records.waiter_ticket.tolist())
        if ticket and _is_locked(fd, _QUEUE_BASE + place)
    ]
    return sorted(waiting, key=lambda waiter: waiter.ticket)


class HoldLog:
    """An ``on_hold`` recorder that appends each hold as one line to a file shared by many processes.

    Each line is written with a single O_APPEND write, so lines from concurrent processes never
    interleave. ``read_holds`` reads them back and ``max_concurrent`` proves exclusivity from them.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, hold: HoldInterval) -> None:
        slot = -1 if hold.slot is None else hold.slot
        line = f"{hold.device_key} {hold.pid} {slot} {hold.start!r} {hold.end!r}\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def read_holds(path: Path) -> list[HoldInterval]:
    holds = []
    for line in path.read_text().splitlines():
        key, pid, slot, start, end = line.split()
        number = None if slot == "-1" else int(slot)
        holds.append(HoldInterval(key, int(pid), number, float(start), float(end)))
    return holds


def max_concurrent(holds: Iterable[HoldInterval]) -> int:
    """The largest number of holds open at one instant (a hold ending when another starts does not count)."""
    events = sorted([(h.start, 1) for h in holds] + [(h.end, -1) for h in holds])
    most = current = 0
    for _, step in events:
        current += step
        most = max(most, current)
    return most


def default_lock_dir() -> Path:
    """``$MPSERVE_LOCK_DIR``, else ``mpserve-locks-UID`` under /dev/shm (or the temp dir): this user's servers
    meet there. Made 0700 if missing, refused if another user owns it or others may enter it."""
    configured = os.environ.get("MPSERVE_LOCK_DIR")
    if configured:
        path = Path(configured)
    else:
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
        path = base / f"mpserve-locks-{os.geteuid()}"
    return private_dir(path, LOCK_FOLDER)


def _lock_folder(given: Path | None) -> Path:
    """``given`` once checked private (it must exist), else the default folder."""
    if given is None:
        return default_lock_dir()
    check_private_dir(given, LOCK_FOLDER)
    return given


# -- the file's records ----------------------------------------------------------------------------


class _Records:
    """Typed views of the shared mmap: the header and the holder and waiter columns."""

    def __init__(self, fd: int) -> None:
        self._map = mmap.mmap(fd, _FILE_SIZE)  # of a file ``_lock_file_problem`` passed: whole and ours
        view = memoryview(self._map)

        def part(offset: int, count: int) -> memoryview:
            return view[offset : offset + 8 * count]

        self.ticket_counter = part(_TICKET_OFFSET, 1).cast("Q")
        self.holder_pid = part(_HOLDERS, MAX_CAPACITY).cast("q")
        self.holder_since = part(_HOLDERS + 8 * MAX_CAPACITY, MAX_CAPACITY).cast("d")
        self.waiter_pid = part(_WAITERS, QUEUE_PLACES).cast("q")
        self.waiter_ticket = part(_WAITERS + 8 * QUEUE_PLACES, QUEUE_PLACES).cast("Q")
        self.waiter_since = part(_WAITERS + 16 * QUEUE_PLACES, QUEUE_PLACES).cast("d")
        self._views: list[memoryview[Any]] = [
            self.ticket_counter,
            self.holder_pid,
            self.holder_since,
            self.waiter_pid,
            self.waiter_ticket,
            self.waiter_since,
            view,
        ]

    def stored_capacity(self) -> int:
        """The header's capacity (0 = unlimited)."""
        capacity: int = _HEADER.unpack_from(self._map)[2]
        return capacity

    def reset(self, capacity: int) -> None:
        """Start afresh; only for the sole user of the file."""
        self._map[:] = _blank(capacity)

    def draw_ticket(self) -> int:
        """Only under the ticket lock."""
        ticket = self.ticket_counter[0]
        self.ticket_counter[0] = ticket + 1
        return ticket

    def close(self) -> None:
        for view in self._views:  # the mmap refuses to close while views of it are alive
            view.release()
        self._map.close()


# -- OFD byte locks --------------------------------------------------------------------------------


class _Flock(ctypes.Structure):
    """``struct flock`` as this platform's C compiler lays it out (off_t is 64-bit in CPython builds)."""

    _fields_ = [
        ("l_type", ctypes.c_short),
        ("l_whence", ctypes.c_short),
        ("l_start", ctypes.c_int64),
        ("l_len", ctypes.c_int64),
        ("l_pid", ctypes.c_int),  # must be 0 for OFD requests; F_OFD_GETLK reports -1
    ]


@cache
def _request(kind: int, offset: int) -> bytes:
    return bytes(_Flock(kind, os.SEEK_SET, offset, 1, 0))


def _lock(fd: int, offset: int, *, shared: bool = False, wait: bool = False) -> bool:
    """Lock one byte; False if it is held by another description (only when not waiting)."""
    kind = fcntl.F_RDLCK if shared else fcntl.F_WRLCK
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, _request(kind, offset))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _unlock(fd: int, offset: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _request(fcntl.F_UNLCK, offset))


def _is_locked(fd: int, offset: int) -> bool:
    """Whether a description other than ``fd``'s holds the byte."""
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _request(fcntl.F_WRLCK, offset))
    return bool(_Flock.from_buffer_copy(answer).l_type != fcntl.F_UNLCK)


# -- small helpers ---------------------------------------------------------------------------------


def _open_lock_file(path: Path) -> int:
    """The device's lock file, read-write, in a folder ``default_lock_dir`` (or ``check_private_dir``) passed.

    A new one is written whole under a temporary name and linked into place (a link fails if any name is there,
    a planted symbolic link included), so nobody ever opens a partial one. An existing one is opened without
    following a link and used only if it is a regular file of this user's with the size and header of this
    layout; anything else is refused, never truncated or rewritten.
    """
    try:
        try:
            fd = open_private(path, os.O_RDWR)
        except FileNotFoundError:
            fd = _make_lock_file(path)
    except PlantedFile as exc:
        raise ConfigError(f"{exc.strerror}: it is not a permit lock file this server made; remove it "
                          f"(rm {path}) and check who can write in {path.parent}") from None
    except OSError as exc:
        raise ConfigError(f"cannot open permit lock file {path}: {exc.strerror}") from None
    problem = _lock_file_problem(fd)
    if problem:
        os.close(fd)
        raise ConfigError(f"permit lock file {path} {problem}: it is not one this version of mpserve made; "
                          f"remove it (rm {path}) when no server uses the device")
    return fd


def _make_lock_file(path: Path) -> int:
    """A new lock file at ``path`` (or the one another process linked there first), read-write."""
    part = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.part")
    part.unlink(missing_ok=True)  # a dead process's with our pid, in our own folder
    fd = create_private(part, os.O_RDWR)
    try:
        os.write(fd, _blank(0))
        os.link(part, path)
    except FileExistsError:
        os.close(fd)
        return open_private(path, os.O_RDWR)
    except BaseException:
        os.close(fd)
        raise
    finally:
        part.unlink(missing_ok=True)
    return fd


def _lock_file_problem(fd: int) -> str:
    """What is wrong with the opened lock file, or "" if it has this layout's size and header."""
    size = os.fstat(fd).st_size
    if size != _FILE_SIZE:
        return f"has {size} bytes, not {_FILE_SIZE}"
    magic, version, _, _ = _HEADER.unpack(os.pread(fd, _HEADER.size, 0))
    if magic != _MAGIC or version != _LAYOUT_VERSION:
        return "has a foreign header"
    return ""


def _blank(capacity: int) -> bytes:
    """A lock file's bytes before anyone has used it (``capacity`` 0: as yet unlimited)."""
    data = bytearray(_FILE_SIZE)
    _HEADER.pack_into(data, 0, _MAGIC, _LAYOUT_VERSION, capacity, 1)
    return bytes(data)


def _reopen(fd: int) -> int:
    """A new open file description of the file behind ``fd`` (its own OFD locks), never its path again: the name
    could have been replaced since."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


def _never() -> bool:
    return False


def _nap(deadline: float | None, delay: float) -> bool:
    """Sleep ``delay`` between two tries, cut short by the deadline; False once the deadline has passed."""
    if deadline is None:
        time.sleep(delay)
        return True
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    time.sleep(min(delay, left))
    return True


def _describe(capacity: int) -> str:
    return "unlimited" if capacity == 0 else str(capacity)


_OPEN: weakref.WeakSet[DevicePermits] = weakref.WeakSet()


def _forget_all_after_fork() -> None:
    for permits in list(_OPEN):
        permits._forget_after_fork()
    _OPEN.clear()


os.register_at_fork(after_in_child=_forget_all_after_fork)
