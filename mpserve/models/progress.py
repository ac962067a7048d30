"""A download's progress as people watch it: a bar on a terminal (size, speed, time left), redrawn at most a
few times a second; elsewhere (a log file, a service manager) a log line at each tenth of the way.

    download ──start(total, done)──▶ Progress ──advance(n)──▶ terminal: "\\r NAME 42% [####    ] 12/27 MiB ..."
                                              ──finish()───▶ other:    "NAME: 40% (12/27 MiB, 3.1 MiB/s, 5 s left)"
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

log = logging.getLogger("mpserve.download")

_REDRAW_S = 0.2
_BAR = 24


class Progress:
    """One file's download, shown on ``stream`` when it is a terminal, logged by tenths otherwise."""

    def __init__(self, name: str, stream: TextIO | None = None) -> None:
        self.name = name
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty()
        self.total = self.done = 0
        self._resumed = 0
        self._started = self._drawn = 0.0
        self._tenth = 0

    def start(self, total: int, done: int = 0) -> None:
        """``total`` bytes, ``done`` of them already on disk (a resumed download)."""
        self.total, self.done, self._resumed = total, done, done
        self._started = time.monotonic()
        self._tenth = self._tenths()
        if done:
            log.info("%s: resuming at %s of %s", self.name, _size(done), _size(total))
        else:
            log.info("%s: downloading %s", self.name, _size(total))

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self._tty and now - self._drawn >= _REDRAW_S:
            self._drawn = now
            self._stream.write("\r" + self.line(now))
            self._stream.flush()
        elif not self._tty and self._tenths() > self._tenth:
            self._tenth = self._tenths()
            log.info("%s", self.line(now))

    def finish(self) -> None:
        if self._tty:
            self._stream.write("\r" + self.line(time.monotonic()) + "\n")
            self._stream.flush()
        log.info("%s: done, %s", self.name, _size(self.total))

    def line(self, now: float) -> str:
        """What the bar or the log line says: share, size, speed and time left."""
        share = self.done / self.total if self.total else 1.0
        speed = (self.done - self._resumed) / max(now - self._started, 1e-6)
        left = f"{(self.total - self.done) / speed:.0f} s left" if speed > 0 else "time left unknown"
        text = f"{_size(self.done)}/{_size(self.total)}, {_size(int(speed))}/s, {left}"
        if self._tty:
            filled = int(share * _BAR)
            return f"{self.name} {share:4.0%} [{'#' * filled}{' ' * (_BAR - filled)}] {text}"
        return f"{self.name}: {share:.0%} ({text})"

    def _tenths(self) -> int:
        return self.done * 10 // self.total if self.total else 10


def _size(n: float) -> str:
    """Bytes as people read them: 812 B, 3.4 MiB, 1.2 GiB."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    step = 0
    while n >= 1024 and step < len(units) - 1:
        n, step = n / 1024, step + 1
    return f"{n:.0f} B" if step == 0 else f"{n:.1f} {units[step]}"
