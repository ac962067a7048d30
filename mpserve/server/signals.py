"""Signals as events: handlers only write the signal number to a socket pair, and the poll loop that owns
all state reads it (gunicorn's arbiter does the same), so no state is touched from a handler."""

from __future__ import annotations

import signal
import socket
from types import FrameType
from typing import Any


class SignalPipe:
    """While entered, SIGTERM and SIGINT wake whoever polls ``fileno()``; ``received()`` says which."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self._signals = signals
        self._read, self._write = socket.socketpair()
        self._old_wakeup = -1
        self._old_handlers: dict[int, Any] = {}

    def __enter__(self) -> SignalPipe:
        self._read.setblocking(False)
        self._write.setblocking(False)
        self._old_wakeup = signal.set_wakeup_fd(self._write.fileno())
        self._old_handlers = {s: signal.signal(s, _ignore) for s in self._signals}
        return self

    def __exit__(self, *exc: object) -> None:
        signal.set_wakeup_fd(self._old_wakeup)
        for s, handler in self._old_handlers.items():
            signal.signal(s, handler)
        self._read.close()
        self._write.close()

    def fileno(self) -> int:
        return self._read.fileno()

    def received(self) -> set[int]:
        """The watched signals that arrived since the last call."""
        try:
            return {s for s in self._read.recv(64) if s in self._signals}
        except BlockingIOError:
            return set()


def _ignore(signum: int, frame: FrameType | None) -> None:
    """A Python-level handler must exist for the wakeup fd to be written; the loop does the work."""
