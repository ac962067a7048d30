"""Several gateway processes on one HTTP port, each started again when it dies: gunicorn's arbiter, small.

    parent (``mpserve start --http`` or ``mpserve gateway --http-workers N``)
      listen(HOST:PORT) once ──▶ one listening socket, inherited by every child (``--fd``): the kernel gives each
                                 new connection to one child, and a connection not yet accepted waits in the one
                                 shared queue, so a child's death loses only the connections it had accepted
      N × ``mpserve gateway --fd FD …`` (a child: ``app.serve`` on the inherited socket; once its parent is gone
                                         it lets the socket go, finishes its streams and exits:
                                         ``--exit-with-parent``)
      a thread per child waits for it ──▶ it died: logged, started again after RESTART_DELAY_S (doubling up to
                                          MAX_RESTART_DELAY_S while it keeps dying young, within YOUNG_S of its
                                          start); GIVE_UP_AFTER young deaths in a row: ``on_give_up`` (the server
                                          stops with exit status 1, as a gateway that cannot run is a fault for the
                                          service manager to report, not to hide behind restarts)
      signal(SIGHUP) ──▶ each child reads its API key file again and asks for the chat templates again (a reload:
                         ``mpserve reload``, or SIGHUP to the parent of ``mpserve gateway --http-workers N``)
      stop() ──▶ SIGTERM to each child (uvicorn finishes its streams), SIGKILL after STOP_TIMEOUT_S; then the
                 stored responses' file they shared is removed (``store``)
      hand_over() (``mpserve upgrade``: the server executes the mpserve installed now, in its own process) ──▶ the
          listening socket, the children's pids and this process's, in the environment, across the exec ──▶
          ``handed_over`` in the next start (only in the process that handed them over, only a socket listening on
          the very address ``--http`` names): its children serve that very socket (no connection refused), and the
          old ones are told to stop (``drain``): each lets the socket go and finishes its streams, reattached to the
          next server

What the children share lives where each can reach it: the server (over ZeroMQ) and the stored responses (a
SQLite file in the runtime folder, ``api.response_store``). What each counts for itself stays its own: a scrape of
``/metrics`` reads one child's HTTP counters (the server's figures in it are the same from any child).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from mpserve.errors import ConfigError

from .api import response_store

log = logging.getLogger("mpserve.gateway")

RESTART_DELAY_S = 0.5
MAX_RESTART_DELAY_S = 10.0
YOUNG_S = 10.0  # a child that dies sooner after its start counts toward giving up
GIVE_UP_AFTER = 5
STOP_TIMEOUT_S = 10.0
BACKLOG = 2048  # uvicorn's
LISTEN_RETRY_S = 0.1
HANDED_FD, HANDED_PIDS = "MPSERVE_HANDED_HTTP_FD", "MPSERVE_HANDED_HTTP_PIDS"  # an upgrade's
HANDED_BY = "MPSERVE_HANDED_HTTP_BY"  # the pid of the process that handed them over: this one, across its exec
PARENT_ENV = "MPSERVE_GATEWAY_PARENT"  # a child's parent's pid: one that died before the child looked is seen too


def parse_http(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8000`` for IPv6) as (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ConfigError(f"--http must be HOST:PORT (e.g. 127.0.0.1:8000), got {value!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def listen(host: str, port: int, wait: float = 0.0) -> socket.socket:
    """The listening socket every child serves, bound as uvicorn binds one (IPv6 for a host with a colon,
    SO_REUSEADDR), inheritable. ``wait``: how long a port in use may take to be let go (the gateways of a server
    that died let it go as they notice, and finish their streams)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    deadline = time.monotonic() + wait
    while True:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(BACKLOG)
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE and time.monotonic() < deadline:
                time.sleep(LISTEN_RETRY_S)
                continue
            raise ConfigError(f"--http {host}:{port}: cannot listen ({exc.strerror}); give a free port") from None
        sock.set_inheritable(True)
        return sock


def describe(status: int) -> str:
    return f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"


class Fleet:
    """``workers`` children, each run by ``command(fd)`` (its argv, given the listening socket's descriptor) with
    ``env``; ``on_give_up(reason)`` is called once, from a watch thread, when children keep dying young; ``store``:
    the stored responses' file the children share (``api.response_store``), removed by ``stop``."""

    def __init__(self, sock: socket.socket, workers: int, command: Callable[[int], Sequence[str]],
                 env: dict[str, str], on_give_up: Callable[[str], None], store: Path) -> None:
        self._sock, self._store = sock, store
        self._command = command
        self._env = env
        self._on_give_up = on_give_up
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._children: list[subprocess.Popen[bytes] | None] = [None] * workers
        self.restarts = 0
        self.gave_up: str | None = None
        for index in range(workers):
            self._spawn(index)
            threading.Thread(target=self._watch, args=(index,), name=f"gateway-watch-{index}", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return [child.pid for child in self._children if child is not None]

    def _spawn(self, index: int) -> subprocess.Popen[bytes] | None:
        """Child ``index`` started, unless the fleet is stopping (a restart that ``stop`` came before)."""
        with self._lock:
            if self._stopping.is_set():
                return None
            fd = self._sock.fileno()
            child = subprocess.Popen(list(self._command(fd)), env={**self._env, PARENT_ENV: str(os.getpid())},
                                     pass_fds=(fd,), start_new_session=True)
            self._children[index] = child
        return child

    def _watch(self, index: int) -> None:
        delay, young = RESTART_DELAY_S, 0
        while True:
            with self._lock:
                child = self._children[index]
            assert child is not None
            started = time.monotonic()
            status = child.wait()
            if self._stopping.is_set():
                return
            young = young + 1 if time.monotonic() - started < YOUNG_S else 0
            if young >= GIVE_UP_AFTER:
                self._give_up(f"the HTTP gateway (pid {child.pid}) {describe(status)}, the {young}th in a row within "
                              f"{YOUNG_S:g} s of its start")
                return
            delay = delay * 2 if young else RESTART_DELAY_S
            delay = min(delay, MAX_RESTART_DELAY_S)
            log.error("the HTTP gateway (pid %d) %s; starting another in %.1f s (the other gateway processes, if "
                      "any, serve the port meanwhile)", child.pid, describe(status), delay)
            if self._stopping.wait(delay):
                return
            child = self._spawn(index)
            if child is None:
                return
            with self._lock:
                self.restarts += 1
            log.info("the HTTP gateway started again: pid %d", child.pid)

    def _give_up(self, reason: str) -> None:
        with self._lock:
            if self.gave_up is not None:
                return
            self.gave_up = reason
        log.error("%s; stopping", reason)
        self._on_give_up(reason)

    def signal(self, sig: int) -> None:
        """``sig`` to each live child (SIGHUP: they read their API key file and ask for the templates again)."""
        with self._lock:
            children = [child for child in self._children if child is not None and child.poll() is None]
        for child in children:
            child.send_signal(sig)

    def stop(self) -> None:
        """Each child stopped gracefully (SIGTERM), killed past STOP_TIMEOUT_S; the socket closed, the stored
        responses' file removed (an upgrade's ``hand_over`` keeps both for the next start)."""
        with self._lock:
            self._stopping.set()
            children = [child for child in self._children if child is not None]
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in children:
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        self._sock.close()
        response_store.remove(self._store)


    def hand_over(self) -> None:
        """The listening socket and the children left to the start that follows in this process (an upgrade: it
        execs), in the environment: no child is restarted from now on."""
        with self._lock:
            self._stopping.set()
            pids = [child.pid for child in self._children if child is not None and child.poll() is None]
        os.environ[HANDED_FD] = str(self._sock.fileno())
        os.environ[HANDED_PIDS] = ",".join(map(str, pids))
        os.environ[HANDED_BY] = str(os.getpid())


def handed_over(host: str, port: int) -> tuple[socket.socket, list[int]] | None:
    """The listening socket on ``host:port`` and the gateway children that a start before this one in this process
    handed over (``Fleet.hand_over``), taken out of the environment; None if there are none, if they were not handed
    over in this process (variables inherited from another), or if the descriptor is not a socket listening on that
    very address (one on another host, such as 0.0.0.0 for 127.0.0.1, would escape the checks made on ``host``)."""
    fd, pids = os.environ.pop(HANDED_FD, None), os.environ.pop(HANDED_PIDS, "")
    by = os.environ.pop(HANDED_BY, None)
    if fd is None or not fd.isdigit():
        return None
    if by != str(os.getpid()):
        log.warning("ignoring %s=%s: it was not handed over by an upgrade of this process; binding anew", HANDED_FD, fd)
        return None
    try:
        sock = socket.socket(fileno=int(fd))
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and _bound_to(sock, host, port)
    except OSError:
        return None
    if not listening:
        log.warning("the HTTP socket handed over (descriptor %s) is not listening on %s:%d; binding anew", fd, host,
                    port)
        return None
    sock.set_inheritable(True)
    return sock, [int(pid) for pid in pids.split(",") if pid.isdigit() and ppid(int(pid)) == os.getpid()]


def _bound_to(sock: socket.socket, host: str, port: int) -> bool:
    """Whether ``sock`` is bound where ``listen(host, port)`` binds: the same family, address and port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if sock.family != family or sock.getsockname()[1] != port:
        return False
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)}
    except OSError:
        return False
    return bool(sock.getsockname()[0] in addresses)


def drain(pids: list[int]) -> None:
    """The gateway children of the start before this one (an upgrade) stopped gracefully, and reaped: each lets
    the listening socket go and finishes its streams first."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        threading.Thread(target=os.waitpid, args=(pid, 0), name=f"gateway-drain-{pid}", daemon=True).start()
    if pids:
        log.info("the gateway processes of the start before this one finish their streams: %s",
                 " ".join(map(str, pids)))


def ppid(pid: int) -> int:
    """The parent of process ``pid`` (0 if it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def child_command(argv: Sequence[str], fd: int) -> list[str]:
    """``mpserve gateway`` ARGV, as one child of a fleet: on the inherited socket ``fd``, one process."""
    return [*argv, "--http-workers", "1", "--fd", str(fd), "--exit-with-parent"]
