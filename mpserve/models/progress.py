"""A download's progress as people watch it: a bar on a terminal (size, speed, time left), redrawn at most a
few times a second; elsewhere (a log file, a service manager) a log line at each tenth of the way. Each
download also keeps a status file in the runtime folder while it runs, which the HTTP gateway shows in
/backend/monitor and the console (``downloads``).

    download ──start(total, done)──▶ Progress ──advance(n)──▶ terminal: "\\r NAME 42% [####    ] 12/27 MiB ..."
                                              ──finish()───▶ other:    "NAME: 40% (12/27 MiB, 3.1 MiB/s, 5 s left)"
                                                         └──▶ $RUNTIME/downloads/PID-NAME.json ──downloads()──▶ gateway
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from mpserve.runtime import pid_alive, runtime_dir

log = logging.getLogger("mpserve.download")

_REDRAW_S = 0.2
_PUBLISH_S = 0.5
_BAR = 24


class Progress:
    """One file's download, shown on ``stream`` when it is a terminal, logged by tenths otherwise."""

    def __init__(self, name: str, stream: TextIO | None = None) -> None:
        self.name = name
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty()
        self.total = self.done = 0
        self._resumed = 0
        self._started = self._drawn = self._published = 0.0
        self._tenth = 0
        self._status = _folder() / f"{os.getpid()}-{re.sub(r'[^A-Za-z0-9._-]', '_', name)}.json"

    def start(self, total: int, done: int = 0) -> None:
        """``total`` bytes, ``done`` of them already on disk (a resumed download)."""
        self.total, self.done, self._resumed = total, done, done
        self._started = time.monotonic()
        self._tenth = self._tenths()
        self._publish(self._started)
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
        if now - self._published >= _PUBLISH_S:
            self._publish(now)

    def finish(self) -> None:
        if self._tty:
            self._stream.write("\r" + self.line(time.monotonic()) + "\n")
            self._stream.flush()
        log.info("%s: done, %s", self.name, _size(self.total))
        self.close()

    def close(self) -> None:
        """The download is over (done or not): its status file goes."""
        self._status.unlink(missing_ok=True)

    def line(self, now: float) -> str:
        """What the bar or the log line says: share, size, speed and time left."""
        share = self.done / self.total if self.total else 1.0
        speed = self._speed(now)
        left = f"{(self.total - self.done) / speed:.0f} s left" if speed > 0 else "time left unknown"
        text = f"{_size(self.done)}/{_size(self.total)}, {_size(int(speed))}/s, {left}"
        if self._tty:
            filled = int(share * _BAR)
            return f"{self.name} {share:4.0%} [{'#' * filled}{' ' * (_BAR - filled)}] {text}"
        return f"{self.name}: {share:.0%} ({text})"

    def _publish(self, now: float) -> None:
        """The status file: written whole, then renamed, so a reader never sees half of it."""
        self._published = now
        speed = self._speed(now)
        status = {"file": self.name, "pid": os.getpid(), "done_bytes": self.done, "total_bytes": self.total,
                  "bytes_per_s": round(speed), "left_s": round((self.total - self.done) / speed, 1) if speed else None}
        tmp = self._status.with_suffix(".tmp")
        tmp.write_text(json.dumps(status))
        tmp.replace(self._status)

    def _speed(self, now: float) -> float:
        return (self.done - self._resumed) / max(now - self._started, 1e-6)

    def _tenths(self) -> int:
        return self.done * 10 // self.total if self.total else 10


def downloads() -> list[dict[str, Any]]:
    """The downloads running on this host: file, pid, bytes done and in all, speed, seconds left (None: not
    known yet). Status files of processes that are gone are removed."""
    found = []
    for path in sorted(_folder().glob("*.json")):
        try:
            status = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced, or gone
        if pid_alive(int(status.get("pid", 0))):
            found.append(status)
        else:
            path.unlink(missing_ok=True)
    return found


def _folder() -> Path:
    folder = runtime_dir() / "downloads"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def _size(n: float) -> str:
    """Bytes as people read them: 812 B, 3.4 MiB, 1.2 GiB."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    step = 0
    while n >= 1024 and step < len(units) - 1:
        n, step = n / 1024, step + 1
    return f"{n:.0f} B" if step == 0 else f"{n:.1f} {units[step]}"
