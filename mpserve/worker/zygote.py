"""A model's zygote: a process that loads the model's weights once and forks the model's instances, which then
share those pages copy-on-write instead of each holding its own copy.

    supervisor --fork server--> zygote_main: CUDA hidden, own session, the llama.cpp model loaded and its LoRA
                                adapters onto it (no context, no decode: llama.cpp's thread pool and OpenMP are
                                not started before a fork)
    supervisor --WorkerSpec over the pipe--> zygote --os.fork--> child: worker_main(spec, model), the loop a
                                                                 started worker runs; it makes its own context
                                                                 and warms it up (its first decode)
    zygote --("forked", index, pid)--> supervisor       after each fork (pid 0: the fork failed)
    zygote --("exited", pid, exit code)--> supervisor   once it has reaped that child (pidfd readable)

A child needs nothing of the zygote once forked: it runs in its own session, watches the server (its spec's
``parent_pid``), not the zygote, and outlives a zygote that dies. Nothing in a child writes to the weights:
llama.cpp reads them, and a child that unloads frees only its own mapping (a later load reads the file). The
zygote exits when the supervisor says stop (None) and closes its end of the pipe, and leaves its children
running. If the model cannot be loaded here, the zygote forks children without it: each loads the file and
reports the failure as a started worker does.

A server that dies (or execs itself for an upgrade) closes the pipe without a word: the zygote, ``Adoptable``,
keeps its weights and waits for the next start of that server, so that it loads nothing again:

    pipe EOF ──▶ listen at adoptable.path (created 0600 in the private runtime folder) for adoptable.wait s,
                 reaping children meanwhile (their exits are nobody's news now)
    a connection from a process of this user's (SO_PEERCRED) that proves it knows the secret, and to which
    the zygote proves it too (``multiprocessing.connection``'s challenge, both ways, within CHALLENGE_TIMEOUT_S)
        ──▶ ("adopted", pid, revision, engine as a dict) ──▶ the new server: the pipe's protocol again on that
            connection; it sends its own secret (a str) for the adoption after it, or None (another mpserve or
            another engine: stop)
    nobody within the wait ──▶ exit (the children, adoptable themselves, stay)

A zygote that is killed itself would leave its model to be loaded again. So each keeps a spare: a fork of itself
(single-threaded, no context: safe to fork), its weights shared copy-on-write, that closes the zygote's pipe and
listening socket and waits at ``Adoptable.spare_path`` while the zygote lives, and ``adoptable.wait`` s after:

    zygote dies ──▶ the server sees its pipe end ──▶ connects to the spare, both prove the secret ──▶ the spare
        listens at the zygote's path, forks a spare of its own, and forks the instances from then on
    the zygote stops (None), or gives up waiting ──▶ it kills its spare first
    the zygote learns a new server's secret ──▶ its spare is replaced by one that knows it
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import select
import signal
import socket
import struct
import sys
import time
import traceback
import weakref
from multiprocessing import AuthenticationError, connection
from multiprocessing.connection import Connection
from typing import Any

from .main import worker_main
from .spec import CHALLENGE_TIMEOUT_S, Adoptable, EngineSpec, WorkerSpec, revision, time_limit

log = logging.getLogger("mpserve.zygote")


def zygote_main(engine: EngineSpec, model: str, conn: Connection, log_level: str,
                adoptable: Adoptable | None = None) -> None:
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU model: no CUDA context here, before or after a fork
    os.setsid()  # as a worker: Ctrl-C reaches the server, which stops the zygote when it is done
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s zygote ({model}): %(message)s")
    weights = _load(engine)
    zygote = _Zygote(engine, weights, _load_adapters(engine, weights), _load_projector(engine, weights), adoptable)
    zygote.listen()
    zygote.fork_spare(conn)
    zygote.run(conn)


class _Zygote:
    def __init__(self, engine: EngineSpec, weights: Any, adapters: dict[str, Any], projector: Any,
                 adoptable: Adoptable | None) -> None:
        self.engine, self.weights, self.adapters, self.projector = engine, weights, adapters, projector
        self.children: dict[int, int] = {}  # pidfd -> pid, until reaped
        self.adoptable = adoptable if adoptable is not None and adoptable.wait > 0 else None
        self.listener: socket.socket | None = None
        self.spare: tuple[int, int] | None = None  # its spare's (pid, pidfd)

    def listen(self) -> None:
        """Listen where a server that lost this zygote's server looks for it (``Adoptable.path``)."""
        if self.adoptable is not None:
            self.listener = _listen(self.adoptable.path)

    def run(self, conn: Connection | None) -> None:
        """Serve ``conn``'s server, then each server that adopts this zygote, until one says stop or none comes."""
        try:
            while conn is not None and not self.serve(conn):
                conn.close()
                conn = self.wait_for_server()
        finally:
            self.close()
        log.debug("exiting, %d instance(s) keep running", len(self.children))

    def serve(self, conn: Connection) -> bool:
        """Fork what the server asks for over ``conn``, and report each fork and each exit, until it says stop
        (True) or is gone (False)."""
        try:
            while True:
                spare = [self.spare[1]] if self.spare is not None else []
                ready, _, _ = select.select([conn.fileno(), *self.children, *spare], [], [])
                for pid, code in self._reap([fd for fd in ready if fd in self.children]):
                    with contextlib.suppress(OSError):  # a server that said stop and closed the pipe: read below
                        conn.send(("exited", pid, code))
                if spare and spare[0] in ready:  # the spare was killed: another
                    self.fork_spare(conn)
                if conn.fileno() not in ready:
                    continue
                msg = conn.recv()
                if msg is None:
                    return True
                if isinstance(msg, str):  # the secret of the server that adopted this zygote: for the next one
                    if self.adoptable is not None:
                        self.adoptable = dataclasses.replace(self.adoptable, secret=msg)
                        self.fork_spare(conn)  # one that knows it
                    continue
                spec: WorkerSpec = msg
                spare = [self.spare[1]] if self.spare is not None else []
                pid = _fork(spec, (self.weights, self.adapters, self.projector), [conn, self.listener],
                            [*self.children, *spare])
                if pid:
                    self.children[os.pidfd_open(pid)] = pid
                conn.send(("forked", spec.index, pid))
        except (EOFError, OSError):  # the server closed the pipe without a word, or is gone
            return False

    def wait_for_server(self) -> Connection | None:
        """The connection of the next start of the server, once it proved itself; None if none came in time."""
        if self.listener is None or self.adoptable is None:
            return None
        deadline = time.monotonic() + self.adoptable.wait
        log.warning("the server is gone; waiting %g s for its next start to adopt this zygote (%d instance(s) keep "
                    "running)", self.adoptable.wait, len(self.children))
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.listener.fileno(), *self.children], [], [], left)
            self._reap([fd for fd in ready if fd in self.children])
            if self.listener.fileno() in ready:
                conn = self._adopted_by(self.listener)
                if conn is not None:
                    log.info("adopted by a new start of the server")
                    return conn
        log.warning("no server adopted this zygote within %g s; exiting", self.adoptable.wait)
        return None

    def fork_spare(self, conn: Connection) -> None:
        """A copy of this zygote, its weights shared (copy-on-write), that takes its place should it be killed
        (``_wait_as_spare``); the one before it stopped."""
        if self.adoptable is None:
            return
        self._stop_spare()
        parent = os.getpid()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as exc:
            log.warning("cannot fork a spare (%s): a zygote killed will load the model again", exc)
            return
        if pid:
            self.spare = (pid, os.pidfd_open(pid))
            return
        code = 1
        try:
            for item in (conn, self.listener):  # the server sees the pipe's end when the zygote dies, not later
                if item is not None:
                    item.close()
            for fd in self.children:
                os.close(fd)
            self.children, self.listener = {}, None
            promoted = self._wait_as_spare(parent)
            if promoted is not None:
                self.listen()
            self.run(promoted)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)

    def _wait_as_spare(self, parent: int) -> Connection | None:
        """As a spare: wait while zygote ``parent`` lives (and adoptable.wait s after it died) for its server to
        take this one in its place; the connection, once it proved itself, or None."""
        assert self.adoptable is not None
        try:
            alive: int | None = os.pidfd_open(parent)
        except ProcessLookupError:
            alive = None
        deadline = None if alive is not None else time.monotonic() + self.adoptable.wait
        listener = _listen(self.adoptable.spare_path)
        try:
            while deadline is None or (left := deadline - time.monotonic()) > 0:
                watched = [listener.fileno(), *([alive] if alive is not None else [])]
                ready, _, _ = select.select(watched, [], [], None if deadline is None else left)
                if alive is not None and alive in ready:
                    os.close(alive)
                    alive, deadline = None, time.monotonic() + self.adoptable.wait
                    log.warning("the zygote (pid %d) died; this spare waits %g s for its server", parent,
                                self.adoptable.wait)
                if listener.fileno() in ready:
                    conn = self._adopted_by(listener)
                    if conn is not None:
                        log.info("the zygote's spare takes its place (pid %d)", os.getpid())
                        return conn
            return None
        finally:
            _unlisten(listener, self.adoptable.spare_path)

    def _adopted_by(self, listener: socket.socket) -> Connection | None:
        """The connection waiting on ``listener``, once it proved itself, told who this zygote is."""
        assert self.adoptable is not None
        conn = _proven(listener, self.adoptable.secret.encode())
        if conn is not None:
            conn.send(("adopted", os.getpid(), revision(), dataclasses.asdict(self.engine)))
        return conn

    def _stop_spare(self) -> None:
        if self.spare is not None:
            pid, pidfd = self.spare
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(pidfd)
            self.spare = None
            if self.adoptable is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.adoptable.spare_path)  # what it listened at (only this zygote's spares do)

    def _reap(self, fds: list[int]) -> list[tuple[int, int]]:
        """The children whose pidfd is readable, reaped: (pid, exit code) each."""
        gone = []
        for fd in fds:
            pid = self.children.pop(fd)
            os.close(fd)
            _, status = os.waitpid(pid, 0)
            gone.append((pid, os.waitstatus_to_exitcode(status)))
        return gone

    def close(self) -> None:
        self._stop_spare()
        if self.listener is not None and self.adoptable is not None:
            _unlisten(self.listener, self.adoptable.path)


def _listen(path: str) -> socket.socket:
    """A listening socket at ``path``, this user's only (0600, in the private runtime folder)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a zygote's before, that died (the folder is this user's alone)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    _BOUND[listener] = _file_id(path)
    listener.listen(4)
    return listener


def _unlisten(listener: socket.socket, path: str) -> None:
    """Stop listening, and remove the socket file at ``path`` if it is still the one this listener bound (a later
    zygote of the model may have bound it anew: a new file)."""
    with contextlib.suppress(OSError):
        if _file_id(path) == _BOUND.get(listener):
            os.unlink(path)
    listener.close()


_BOUND: weakref.WeakKeyDictionary[socket.socket, tuple[int, int]] = weakref.WeakKeyDictionary()
"""The file each listener bound: a socket's own descriptor names its socket, not the file (``fstat`` gives the socket
file system's inode), so the file is known by what ``stat`` said right after the bind."""


def _file_id(path: str) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def _proven(listener: socket.socket, secret: bytes) -> Connection | None:
    """The connection waiting on ``listener``, if it comes from a process of this user's and proves it knows
    ``secret`` (as this one proves it to it); None otherwise."""
    sock, _ = listener.accept()
    _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid != os.getuid():
        log.warning("refused a connection of uid %d: only this user's server may adopt this zygote", uid)
        sock.close()
        return None
    sock.setblocking(True)
    time_limit(sock, CHALLENGE_TIMEOUT_S)  # a peer that says nothing is refused, not waited for
    conn = Connection(sock.dup().detach())
    try:
        connection.deliver_challenge(conn, secret)
        connection.answer_challenge(conn, secret)
    except (AuthenticationError, EOFError, OSError) as exc:  # OSError: EAGAIN, past the time limit
        log.warning("refused a connection that did not prove it knows the server's secret (%s)", exc)
        conn.close()
        sock.close()
        return None
    time_limit(sock, 0.0)  # proven: the server may be quiet for as long as it likes
    sock.close()
    return conn


def _load(engine: EngineSpec) -> Any:
    """The model's weights, loaded as a worker would load them (None if they cannot be)."""
    import llama_cpp

    from mpserve.engine.model_info import load_model

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # as the engines quiet it
    llama_cpp.llama_backend_init()
    t0 = time.perf_counter()
    try:
        weights = load_model(llama_cpp, engine.path, engine.n_gpu_layers, engine.repack)
    except ValueError as exc:
        log.warning("cannot load %s (%s); each instance tries it itself", engine.path, exc)
        return None
    log.info("loaded %s in %.2f s (repack=%s); instances are forked from here", engine.path,
             time.perf_counter() - t0, engine.repack)
    return weights


def _load_adapters(engine: EngineSpec, weights: Any) -> dict[str, Any]:
    """The model's LoRA adapters loaded onto ``weights``, so that every instance shares their tensors; none if one
    cannot be (each instance then loads them itself, and one that cannot reports why)."""
    if weights is None or not engine.adapters:
        return {}
    import llama_cpp

    from mpserve.engine.adapters import preload
    from mpserve.errors import MpserveError

    try:
        return preload(llama_cpp, weights, engine.path, engine.adapters)
    except MpserveError as exc:
        log.warning("cannot load the adapters here (%s); each instance tries them itself", exc.message)
        return {}


def _load_projector(engine: EngineSpec, weights: Any) -> Any:
    """The model's image projector loaded beside ``weights``, so that every instance shares its tensors (copy-on-write
    pages, never written); None if there is none or it cannot be (each instance then loads it itself). Not warmed
    up: a warm-up computes, and a computation here would start threads that a fork does not carry."""
    if weights is None or not engine.mmproj:
        return None
    from mpserve.engine.media import Projector

    try:
        projector = Projector(engine.mmproj, weights, engine.threads, use_gpu=False, warmup=False)
    except ValueError as exc:
        log.warning("%s; each instance tries it itself", exc)
        return None
    log.info("loaded the projector %s; instances share it", engine.mmproj)
    return projector


def _fork(spec: WorkerSpec, loaded: tuple[Any, dict[str, Any], Any], own: list[Connection | socket.socket | None],
          fds: list[int]) -> int:
    """Fork the instance ``spec`` describes; the child runs the worker with what this zygote ``loaded`` (the model,
    its adapters, its projector) and never returns. The child's pid (0 if the fork failed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError as exc:
        log.error("cannot fork worker %d: %s", spec.index, exc)
        return 0
    if pid:
        return pid
    code = 1
    try:
        for item in own:  # the zygote's: the pipe, its listening socket
            if item is not None:
                item.close()
        for fd in fds:  # the zygote's pidfds: of its children and its spare
            os.close(fd)
        worker_main(spec, *loaded)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
