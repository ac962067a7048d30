"""A worker's link to its broker, as the worker's loop keeps it alive (the Paranoid Pirate pattern): when a
HEARTBEAT is due, when the broker counts as silent, when to register again (backing off with jitter), the server
process watched, and the wait of an orphan (a worker whose server died) for the next start.

    Worker._keep_alive ──heartbeat_due(now)──▶ HEARTBEAT every interval (none while orphaned)
                       ──server_gone()──▶ the watched server's pidfd readable (or none watched): orphaned or leave
                       ──register_due(now, silent)──▶ told to, or silent past its bound: READY again; silent, on
                                                      a new connection first (``reconnect``); the next try backed off
    Worker._receive ──heard()──▶ the silence clock and the backoff start again
    orphaned(wait, reconnect) ──▶ READY (with LIVE) at once, again after each ORPHAN_RETRY_S of silence, until
                                  ``orphan_until``; adopted(pid) ──▶ that server watched from now on

A pidfd of the server is in the worker's poll too: an idle worker wakes when its server dies.
"""

from __future__ import annotations

import os
import random
import select
import time
from typing import Any

import zmq

from .spec import WorkerSpec

REGISTER_BACKOFF_FIRST_S = 0.5
REGISTER_BACKOFF_MAX_S = 5.0
ORPHAN_RETRY_S = 2.0  # orphaned: READY again, on a new link, after this long without a word from a broker
HAND_OFF_WAIT_S = 30.0  # handed off with adopt_wait 0: how long it waits for the next server all the same


class BrokerLink:
    """The state of one worker's link: its socket, the poller its loop waits on, and the clocks above."""

    def __init__(self, spec: WorkerSpec, sock: zmq.Socket[Any], poller: zmq.Poller) -> None:
        self._spec = spec
        self.sock = sock
        self._poller = poller
        self._server: int | None = None  # the watched server's pidfd
        self.watch(spec.parent_pid)
        self.orphan_until: float | None = None  # orphaned (its server died): when it gives up waiting for another
        self.must_register = False  # the broker said it does not know this worker, or it was orphaned
        self.registered = False  # READY sent once at least
        self._next_heartbeat = 0.0
        self._heard = time.monotonic()
        self._backoff = REGISTER_BACKOFF_FIRST_S
        self._next_register = 0.0

    @property
    def orphaned_now(self) -> bool:
        return self.orphan_until is not None

    def heard(self) -> None:
        """A message came from the broker."""
        self._heard = time.monotonic()
        self._backoff = REGISTER_BACKOFF_FIRST_S

    def registering(self) -> None:
        """READY is going out: the broker gets a full expiry to answer it before the next try."""
        self.registered, self.must_register = True, False
        self._heard = time.monotonic()

    def heartbeat_due(self, now: float) -> bool:
        """Whether a HEARTBEAT goes out now (one an interval; none while orphaned: READY stands for it)."""
        if now < self._next_heartbeat or self.orphaned_now:
            return False
        self._next_heartbeat = now + self._spec.heartbeat_interval
        return True

    def silent_for(self, now: float) -> float | None:
        """How long the broker has said nothing, if that is past its bound (interval × liveness; an orphan's:
        ORPHAN_RETRY_S); None otherwise."""
        bound = (self._spec.heartbeat_interval * self._spec.heartbeat_liveness if not self.orphaned_now
                 else ORPHAN_RETRY_S)
        return now - self._heard if now - self._heard > bound else None

    def register_due(self, now: float, silent: bool) -> bool:
        """Whether READY goes out again now: told to, or silent and past the backoff. If so, the next try is backed
        off (doubled up to REGISTER_BACKOFF_MAX_S, with jitter)."""
        if not (self.must_register or (silent and now >= self._next_register)):
            return False
        self._backoff = min(REGISTER_BACKOFF_MAX_S, self._backoff * 2)
        self._next_register = now + self._backoff * random.uniform(0.5, 1.5)
        return True

    def server_gone(self) -> bool:
        """Whether the watched server has exited (or none is watched): one syscall, every turn."""
        return self._server is None or bool(select.select([self._server], [], [], 0)[0])

    def orphaned(self, reconnect: bool) -> None:
        """Its server died (or handed it off, ``reconnect`` False: the first READY answers the broker that hands it
        off, on the link it has): wait ``adopt_wait`` s (HAND_OFF_WAIT_S if that is 0) for the next start,
        registering at once."""
        self.watch(None)
        self.orphan_until = time.monotonic() + (self._spec.adopt_wait or HAND_OFF_WAIT_S)
        if reconnect:
            self.reconnect()
        self.must_register = True
        self._backoff = REGISTER_BACKOFF_FIRST_S

    def adopted(self, server_pid: int) -> None:
        """A new server's broker took this worker: watch that server from now on."""
        self.orphan_until = None
        self.watch(server_pid)

    def watch(self, pid: int | None) -> None:
        """Watch server ``pid`` (None: none) instead of the one watched so far. The worker's parent is the fork
        server or a zygote, not the server, so the server is watched by its pid."""
        if self._server is not None:
            self._poller.unregister(self._server)
            os.close(self._server)
        self._server = None
        if pid is not None:
            try:
                self._server = os.pidfd_open(pid)
            except ProcessLookupError:  # gone already
                return
            self._poller.register(self._server, zmq.POLLIN)

    def reconnect(self) -> None:
        """A new connection to the broker, the old one dropped at once with what it still held (LINGER 0 for the
        disconnect only). Left to linger, to deliver what it held, the old one could still reach a broker that came
        back, which took this worker's name from its stale READY, lost it when that connection closed, and refused
        the new connection that claimed the name meanwhile: registered, the worker was unreachable until it gave
        up waiting and connected again."""
        linger = self.sock.getsockopt(zmq.LINGER)  # for the socket's close: its last messages (LEAVING) go out
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.disconnect(self._spec.backend)
        self.sock.setsockopt(zmq.LINGER, linger)
        self.sock.connect(self._spec.backend)
