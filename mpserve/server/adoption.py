"""A server that takes over the instances of the one that died before it (SIGKILL, a crash, the OOM killer): the
weights stay where they are loaded, and the requests those instances ran go on.

    previous start:  NAME.link (0600): the secrets its instances prove themselves with (``link``), its own and
                     those it adopted; the slot table: each instance's pid, worker index, model and start time
    the server dies ─▶ each instance parks what it runs and offers it for ``adopt_wait`` seconds (READY with LIVE,
                     ``mpserve.worker.loop``); its clients, silent, send their requests again (``Request.reattach``)
    start ─▶ survey(paths, specs) before the dead server's files are cleared: the instances whose process still
             runs (this user's, started when its row says), at the same index with the same model and rows
          ─▶ the supervisor starts every other instance and watches these (``AdoptedWorker``: a pidfd); the broker
             accepts their secrets and keeps the reattached requests it cannot place until they registered
             (``Broker.expect``): each READY's LIVE requests wait, parked there, for their clients (``Adoptions``)
    an instance that does not register within ``adopt_wait`` ─▶ SIGKILL, and started anew as any lost one
    the first instance this start forks of a model ─▶ adopt_zygote: the dead server's zygote of the model, waiting
             at its socket (``mpserve.worker.zygote``), proven both ways with the dead server's secret, this user's,
             holding the weights this start would load ─▶ it forks the instances; nothing is loaded again

The secret file is written through ``create_private`` and read through ``open_private`` (a regular file of this
user's, never through a link): a process of another user cannot plant secrets that would let its workers in.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError, connection
from multiprocessing.connection import Connection
from pathlib import Path

from mpserve.private import PlantedFile, create_private, open_private
from mpserve.runtime import ServerPaths, runtime_dir
from mpserve.wire.slots import SlotState, SlotTable
from mpserve.worker.spec import CHALLENGE_TIMEOUT_S, EngineSpec, WorkerSpec, revision, time_limit, weights_of

from .state import Pending
from .zygotes import PidfdHandle, Zygote, readable

log = logging.getLogger("mpserve.server")

START_SLACK_S = 1.0  # a process that began this much after its row's start time (clocks' rounding) is another's
HOLD_S = 60.0  # an adopted request no client reattached to within this long is cancelled on its instance
ZYGOTE_CONNECT_S = 2.0  # how long a zygote waiting to be adopted may take to answer each step


def secrets_path(paths: ServerPaths) -> Path:
    return _secrets_file(paths.name)


def died_before(name: str) -> bool:
    """Whether the last server of ``name`` died without stopping (its secret file is left)."""
    return _secrets_file(name).exists()


def _secrets_file(name: str) -> Path:
    return runtime_dir() / f"{name}.link"


@dataclass(frozen=True)
class Survivors:
    """What the dead server left to adopt: the secrets its instances prove themselves with, and each instance whose
    process runs on, by worker index (its pid)."""

    secrets: tuple[str, ...] = ()
    pids: dict[int, int] = field(default_factory=dict)


def survey(paths: ServerPaths, specs: list[WorkerSpec]) -> Survivors:
    """The instances the dead server of ``paths`` left running that this start may adopt: at the index of a spec
    with the same model and slot-table rows. Nothing when its secret file is missing or unusable, no instance when its
    slot table is (its zygotes may still be adopted)."""
    secrets = _read_secrets(secrets_path(paths))
    if not secrets:
        return Survivors()
    try:
        rows = SlotTable.read_rows(paths.slots)
    except (OSError, ValueError):
        return Survivors(secrets)
    by_index = {spec.index: spec for spec in specs}
    found: dict[int, int] = {}
    for index in {r.worker for r in rows if r.state not in (SlotState.EMPTY, SlotState.DEAD, SlotState.FAILED)}:
        mine = [r for r in rows if r.worker == index and r.state is not SlotState.EMPTY]
        spec = by_index.get(index)
        pid = mine[0].pid
        if (spec is None or not pid or any(r.pid != pid or r.model != spec.model for r in mine)
                or sorted(r.index for r in mine) != list(spec.rows)):
            continue
        if _ours_since(pid, mine[0].started):
            found[index] = pid
    return Survivors(secrets, found)


def _ours_since(pid: int, started: float) -> bool:
    """Whether process ``pid`` runs, is this user's, and is the one that wrote its row at ``started`` (wall clock):
    an instance writes its row once it runs, however long after it began (a loaded host, a spawned worker's imports);
    a process that took the pid after it died began after that. Its start is read from ``/proc/PID/stat`` against
    the boot clock, to the tick (the boot time ``/proc/stat`` gives is whole seconds)."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return False
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return False
    if fields[0] == "Z":
        return False
    began = time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    return began <= started + START_SLACK_S


def _read_secrets(path: Path) -> tuple[str, ...]:
    try:
        fd = open_private(path)
    except FileNotFoundError:
        return ()
    except PlantedFile as exc:
        log.warning("not adopting any instance: %s is not a file of this user's own (%s)", path, exc)
        return ()
    with os.fdopen(fd) as file:
        try:
            secrets = json.load(file)
        except ValueError:
            return ()
    return tuple(s for s in secrets if isinstance(s, str)) if isinstance(secrets, list) else ()


def write_secrets(paths: ServerPaths, secrets: tuple[str, ...]) -> None:
    """This start's secret file: its own secret and those of the instances it adopts (which a later start must take
    too, should it adopt them again)."""
    path = secrets_path(paths)
    path.unlink(missing_ok=True)
    with os.fdopen(create_private(path, os.O_WRONLY), "w") as file:
        json.dump(list(secrets), file)


def remove_secrets(paths: ServerPaths) -> None:
    secrets_path(paths).unlink(missing_ok=True)


def adopt_zygote(model: str, engine: EngineSpec, path: Path, secrets: tuple[str, ...], proof: str) -> Zygote | None:
    """The zygote of ``model`` that the server before this one left waiting at ``path``: a process of this user's
    that proves it knows one of ``secrets`` (as this server proves it to it), runs this code (``revision``) and
    loaded the weights this start would (``EngineSpec.weights``; the context it forks may differ); told this start's
    secret (``proof``), for the start after it. None if there is none (or it is told to stop: other code, other
    weights), or it goes quiet or away in the middle: each step has CHALLENGE_TIMEOUT_S, as the zygote's side."""
    for secret in secrets:
        try:
            answer = _zygote_connection(path, secret.encode())
        except AuthenticationError:
            continue  # a secret of an instance it adopted, not its server's: the next one
        if answer is None:
            return None
        conn, pid = answer
        try:
            if not _takes(conn, pid, model, engine):
                conn.close()
                return None
            conn.send(proof)
        except (EOFError, OSError):
            conn.close()
            return None
        _limit(conn, 0.0)  # adopted: the zygote may be quiet for as long as it likes
        log.info("%s's zygote (pid %d) outlived the server before this one; adopted: its weights fork the instances",
                 model, pid)
        return Zygote(model, conn, AdoptedWorker(pid), engine.weights())
    return None


def _takes(conn: Connection, pid: int, model: str, engine: EngineSpec) -> bool:
    """Whether the zygote at ``conn`` (proven), told who it is, runs this code and loaded ``engine``'s weights; one
    that does not is told to stop."""
    said = conn.recv() if conn.poll(ZYGOTE_CONNECT_S) else None
    if not (isinstance(said, tuple) and len(said) == 4 and said[:2] == ("adopted", pid)):
        return False
    if said[2] != revision() or not isinstance(said[3], dict) or weights_of(said[3]) != engine.weights():
        log.info("%s's zygote (pid %d) of the server before this one runs other code (%s) or loaded the model "
                 "otherwise; stopping it", model, pid, said[2])
        conn.send(None)
        return False
    return True


def _zygote_connection(path: Path, secret: bytes) -> tuple[Connection, int] | None:
    """A connection to the zygote listening at ``path`` and its pid, proven both ways with ``secret``; None if
    nobody of this user's listens there (AuthenticationError if it knows another secret)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(ZYGOTE_CONNECT_S)
    try:
        sock.connect(str(path))
        pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                         struct.calcsize("3i")))
    except OSError:
        sock.close()
        return None
    if uid != os.getuid():
        log.warning("not adopting the zygote at %s: its process is another user's (uid %d)", path, uid)
        sock.close()
        return None
    sock.settimeout(None)
    time_limit(sock, CHALLENGE_TIMEOUT_S)  # a zygote that goes quiet in the middle is given up, not waited for
    conn = Connection(sock.detach())
    try:
        if not conn.poll(ZYGOTE_CONNECT_S):  # it has not taken the connection: not waiting to be adopted
            conn.close()
            return None
        connection.answer_challenge(conn, secret)
        connection.deliver_challenge(conn, secret)
    except AuthenticationError:
        conn.close()
        raise
    except (EOFError, OSError):
        conn.close()
        return None
    return conn, pid


def _limit(conn: Connection, seconds: float) -> None:
    """``time_limit`` on the socket under ``conn`` (a descriptor of it, closed after)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        time_limit(sock, seconds)


class AdoptedWorker(PidfdHandle):
    """An instance of the dead server, as the supervisor sees it: the surface of a multiprocessing process (pid,
    sentinel, exitcode, is_alive, terminate, kill, join, close) over a pidfd. Its parent is not this server, so its
    exit code is unknown (None): its end counts as a lost instance's."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.exitcode: int | None = None
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._done = os.eventfd(1)

    @property
    def sentinel(self) -> int | None:
        return self._pidfd if self._pidfd is not None else self._done

    def is_alive(self) -> bool:
        return self._pidfd is not None and not readable(self._pidfd, 0.0)

    def join(self, timeout: float | None = None) -> None:
        readable(self._pidfd, timeout)


@dataclass
class Adoptions:
    """The broker's side: the requests adopted instances brought (by tenant and request id: each choice's row and
    the text it streamed), waiting for their clients until ``HOLD_S`` after they came; and the instances still
    expected, until when."""

    waiting: dict[tuple[str, str], list[tuple[Pending, str]]] = field(default_factory=dict)
    since: dict[tuple[str, str], float] = field(default_factory=dict)
    expected: set[bytes] = field(default_factory=set)  # identities of adoptable instances not registered yet
    adoptees: set[bytes] = field(default_factory=set)  # every adoptable instance's, registered or not
    until: float = 0.0  # monotonic: when the broker stops expecting them

    def expecting(self, now: float) -> bool:
        """Whether an adoptable instance may still register (a reattached request unknown yet waits for it)."""
        return bool(self.expected) and now < self.until

    def hold(self, p: Pending, text: str, now: float) -> None:
        key = (p.tenant, p.request.id)
        self.waiting.setdefault(key, []).append((p, text))
        self.since.setdefault(key, now)

    def take(self, tenant: str, request_id: str, journaled: bool = True) -> list[tuple[Pending, str]]:
        """The rows held for ``request_id`` of ``tenant``; those of the journal alone (parked nowhere) only if
        ``journaled``."""
        rows = self.waiting.get((tenant, request_id), [])
        if not journaled and rows and all(p.parked_on is None for p, _ in rows):
            return []
        self.since.pop((tenant, request_id), None)
        return self.waiting.pop((tenant, request_id), [])

    def journaled(self, tenant: str, request_id: str) -> list[Pending]:
        """The journal's rows held for ``request_id`` of ``tenant`` (parked nowhere), taken out."""
        rows = self.waiting.get((tenant, request_id), [])
        taken = [p for p, _ in rows if p.parked_on is None]
        if taken:
            rows[:] = [(p, text) for p, text in rows if p.parked_on is not None]
        return taken

    def held(self) -> list[Pending]:
        """Every row held."""
        return [p for rows in self.waiting.values() for p, _ in rows]

    def expired(self, now: float) -> list[Pending]:
        """The rows no client reattached to within HOLD_S, taken out."""
        old = [key for key, since in self.since.items() if now - since > HOLD_S]
        return [p for key in old for p, _ in self.take(*key)]
