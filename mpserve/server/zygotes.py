"""The supervisor's side of a model's zygote (``mpserve.worker.zygote``): the zygote started through the
supervisor's fork server, asked over a pipe to fork each instance, and a handle per forked instance.

    Supervisor.spawn ─▶ Zygote.fork(spec) ─WorkerSpec─▶ zygote
    zygote ──("forked", index, pid)──▶ Zygote.pump ─▶ handle.pid, and a pidfd as its sentinel
    zygote ──("exited", pid, code)───▶ Zygote.pump ─▶ handle.exitcode
    zygote gone (EOF on the pipe) ───▶ Zygote.pump ─▶ its handles orphaned
    Zygote.close ──None, EOF──▶ the zygote exits; Zygote.hand_off (an upgrade) ──EOF──▶ it waits to be adopted

A zygote whose server died waits at ``socket_path`` to be adopted (``mpserve.worker.zygote``); the next start
connects there before it would start one (``mpserve.server.adoption.adopt_zygote``), and drives it over that
connection as over the pipe: its instances are forked from the weights it loaded then. A zygote that dies itself
is replaced by its spare, adopted the same way at ``socket_path(…, spare=True)`` (``Supervisor._zygote_gone``).

``ForkedWorker`` has the surface the supervisor uses of a multiprocessing process (pid, sentinel, exitcode,
is_alive, terminate, kill, join, close). Its sentinel is a pidfd, readable once the instance has exited (a
pidfd works for a process that is not the server's child); until the zygote has answered there is none yet
(``sentinel`` None: the supervisor watches it later). Its exit code comes from the zygote, which reaps it; an
instance whose zygote died first is reaped by init, and its exit code is unknown (None). An instance the
zygote never forked (the zygote died first, or the fork failed) is "exited" at once: its sentinel is an
eventfd that is readable from the start.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import select
import signal
import time
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Protocol

from mpserve.runtime import runtime_dir
from mpserve.worker.spec import Adoptable, EngineSpec, WorkerSpec, spare_path, zygote_run

log = logging.getLogger("mpserve.supervisor")


class PidfdHandle:
    """A process the supervisor did not start itself, signalled through its pidfd: what a forked instance and an
    adopted one (``mpserve.server.adoption``) share."""

    _pidfd: int | None = None
    _done: int | None = None  # an eventfd, readable at once: for an instance that has no pidfd

    def terminate(self) -> None:
        self._send(signal.SIGTERM)

    def kill(self) -> None:
        self._send(signal.SIGKILL)

    def close(self) -> None:
        for fd in (self._pidfd, self._done):
            if fd is not None:
                os.close(fd)
        self._pidfd = self._done = None

    def _send(self, sig: int) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):  # exited, not reaped yet
                signal.pidfd_send_signal(self._pidfd, sig)


class ForkedWorker(PidfdHandle):
    """One instance forked by a zygote, as the supervisor sees it."""

    def __init__(self, zygote: Zygote) -> None:
        self._zygote = zygote
        self.pid: int | None = None  # None until the zygote says it forked
        self.exitcode: int | None = None
        self._finished = False  # exited, with its exit code known or never to be known
        self._signals: list[int] = []  # asked for before the pid was known

    @property
    def sentinel(self) -> int | None:
        return self._pidfd if self._pidfd is not None else self._done

    def forked(self, pid: int) -> None:
        """The zygote's answer: the instance's pid (0: not forked)."""
        if not pid:
            self._finish()
            return
        self.pid = pid
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # reaped by the zygote already: its exit code follows on the pipe
            self._done = os.eventfd(1)
        for sig in self._signals:
            self._send(sig)
        self._signals.clear()

    def exited(self, code: int) -> None:
        """The zygote reaped the instance."""
        self.exitcode = code
        self._finish()

    def orphaned(self) -> None:
        """The zygote is gone: an instance it had not forked never will be, and no exit code will come; a running
        instance's pidfd still says when it exits."""
        if self._pidfd is None:
            self._finish()

    def _finish(self) -> None:
        self._finished = True
        if self.sentinel is None:
            self._done = os.eventfd(1)

    def _gone_unreported(self, wait: float) -> bool:
        """Its zygote is gone, and so is the instance (waiting up to ``wait`` s for that)."""
        if not self._zygote.alive and readable(self._pidfd, wait):
            self._finished = True
        return self._finished

    def is_alive(self) -> bool:
        self._zygote.pump()
        return not self._finished and not self._gone_unreported(0.0)

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._finished:
            left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if left < 0:
                return
            if self._zygote.alive:
                self._zygote.pump(left)
            else:
                self._gone_unreported(left)

    def _send(self, sig: int) -> None:
        if self.pid is None and not self._finished:
            self._signals.append(sig)
        elif not self._finished:
            super()._send(sig)


class ZygoteProcess(Protocol):
    """What the supervisor uses of a zygote's process: a multiprocessing process it started, or an adopted one's
    pidfd handle."""

    @property
    def pid(self) -> int | None: ...
    @property
    def exitcode(self) -> int | None: ...
    def is_alive(self) -> bool: ...
    def join(self, timeout: float | None = None) -> None: ...
    def kill(self) -> None: ...
    def close(self) -> None: ...


def socket_path(server: str, model: str, spare: bool = False) -> Path:
    """Where the zygote of ``model`` of server ``server`` waits to be adopted, should its server die; ``spare``:
    where its spare waits to take its place (``Adoptable.spare_path``)."""
    path = str(runtime_dir() / f"{server}.zygote-{hashlib.sha256(model.encode()).hexdigest()[:16]}.sock")
    return Path(spare_path(path) if spare else path)


class Zygote:
    """A model's zygote process and the instances it forked that it has not reported reaped."""

    def __init__(self, model: str, conn: Connection, process: ZygoteProcess, weights: dict[str, object]) -> None:
        """``weights``: what it loaded (``EngineSpec.weights``): the instances it may fork."""
        self.model = model
        self.weights = weights
        self.process = process
        self._conn = conn
        self.alive = True
        self._pending: deque[ForkedWorker] = deque()  # asked, not answered yet, in order
        self._forked: dict[int, ForkedWorker] = {}  # pid -> instance, until the zygote reports its exit

    @classmethod
    def start(cls, mp: ForkServerContext, model: str, engine: EngineSpec, log_level: str,
              adoptable: Adoptable | None) -> Zygote:
        """A new zygote for ``model``, started through the fork server."""
        ours, theirs = mp.Pipe()
        process = mp.Process(target=zygote_run, args=(engine, model, theirs, log_level, adoptable),
                             name=f"mpserve-zygote-{model}", daemon=False)
        process.start()
        theirs.close()
        return cls(model, ours, process, engine.weights())

    def fileno(self) -> int:
        """Readable when the zygote has something to say, or has gone."""
        return self._conn.fileno()

    def fork(self, spec: WorkerSpec) -> ForkedWorker:
        handle = ForkedWorker(self)
        if not self.alive:
            handle.orphaned()
            return handle
        self._pending.append(handle)
        try:
            self._conn.send(spec)
        except OSError:
            self._gone()
        return handle

    def pump(self, wait: float = 0.0) -> None:
        """Take what the zygote said (waiting up to ``wait`` s for its first word): forks and exits; at EOF,
        it has gone."""
        try:
            while self.alive and self._conn.poll(wait):
                wait = 0.0
                kind, key, value = self._conn.recv()
                if kind == "forked":
                    handle = self._pending.popleft()
                    handle.forked(value)
                    if value:
                        self._forked[value] = handle
                    else:
                        log.error("%s's zygote could not fork worker %d", self.model, key)
                elif kind == "exited" and key in self._forked:
                    self._forked.pop(key).exited(value)
        except (EOFError, OSError):
            self._gone()

    def _gone(self) -> None:
        self.alive = False
        for handle in [*self._pending, *self._forked.values()]:
            handle.orphaned()
        self._pending.clear()
        self._forked.clear()

    @property
    def instances(self) -> int:
        """The instances it forked or is forking that have not exited (as far as it said)."""
        return len(self._pending) + len(self._forked)

    def close(self, timeout: float) -> int | None:
        """Tell the zygote to stop and close the pipe (it exits, its instances keep running), and collect it; its
        exit code."""
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self._conn.close()
        self._gone()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(1.0)
        code = self.process.exitcode
        self.process.close()
        return code

    def hand_off(self) -> None:
        """An upgrade: the pipe closed without a word, so the zygote waits for the next start to adopt it."""
        self._conn.close()
        self._gone()


def readable(fd: int | None, wait: float | None) -> bool:
    """Whether ``fd`` (a pidfd: its process exited) is readable within ``wait`` seconds (None: for ever)."""
    return fd is not None and bool(select.select([fd], [], [], wait)[0])
