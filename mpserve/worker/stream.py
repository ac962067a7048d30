"""One streamed request's text on its way out, as CHUNK messages.

    engine on_token --push(piece)--> ChunkStream --send(text)--> CHUNK to the broker

The first piece goes at once; later pieces are gathered and sent together once ``interval`` seconds have
passed since the last send; ``flush`` sends what is left (just before DONE). Every message costs CPU in
three processes (worker, broker, client) on cores that llama.cpp's threads are using; gathering the pieces
a few steps produce keeps that cost from growing with the token rate (0 sends every piece on its own). The
concatenated chunks are always the whole text.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class ChunkStream:
    __slots__ = ("_send", "_interval", "_parts", "_sent_at")

    def __init__(self, send: Callable[[str], None], interval: float) -> None:
        self._send = send
        self._interval = interval
        self._parts: list[str] = []
        self._sent_at = -interval  # the first piece goes at once

    def push(self, text: str) -> None:
        self._parts.append(text)
        now = time.monotonic()
        if now - self._sent_at >= self._interval:
            self._sent_at = now
            self.flush()

    def flush(self) -> None:
        if self._parts:
            text = "".join(self._parts)
            self._parts.clear()
            self._send(text)
