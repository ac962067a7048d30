"""One tier of the host store (``mpserve.engine.host_store``): a folder of entry files with a size, shared by every
process on the host under a lock of its own.

    HostStore ──lock()──▶ fcntl lock on ``root/lock`` (released by the kernel when its holder dies)
              ──listing()──▶ every key's entries, least recently used first (orphaned temporary files removed)
              ──held() / names()──▶ its bytes (listed at most every STATS_EVERY_S), this key's entry names
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mpserve.config.loader import tier_folder
from mpserve.private import FILE_MODE, private_dir

from .store_format import SUFFIX

PART = ".kvpart"  # an entry being written: ".tmp-PID-THREAD.kvpart"
STATS_EVERY_S = 1.0  # a tier's bytes are listed at most this often for stats


class Tier:
    """One folder of entries with a size: the RAM tier (tmpfs) or the disk tier."""

    def __init__(self, name: str, root: Path, capacity: int, key: str, durable: bool) -> None:
        self.name, self.root, self.capacity, self.durable = name, root, capacity, durable
        private_dir(root, tier_folder(name))
        self.dir = private_dir(root / key, tier_folder(name))
        self._held, self._listed_at = 0, 0.0

    @contextmanager
    def lock(self) -> Iterator[None]:
        """The tier's lock, across processes; the kernel releases it when its holder dies."""
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def path(self, name: str) -> Path:
        return self.dir / name

    def listing(self) -> list[tuple[int, int, Path]]:
        """(mtime ns, bytes, path) of every file in the tier, every key's, least recently used first. Under the
        lock: temporary files are orphans of a killed writer, and are removed."""
        found = []
        for folder in self.root.iterdir():
            if not folder.is_dir():
                continue
            for item in os.scandir(folder):
                try:
                    if item.name.endswith(PART):
                        os.unlink(item.path)
                    elif item.name.endswith(SUFFIX):
                        st = item.stat()
                        found.append((st.st_mtime_ns, st.st_size, Path(item.path)))
                except FileNotFoundError:
                    continue
        found.sort()
        self._held, self._listed_at = sum(size for _, size, _ in found), time.monotonic()
        return found

    def held(self) -> int:
        """The tier's bytes, listed at most every STATS_EVERY_S."""
        if time.monotonic() - self._listed_at > STATS_EVERY_S:
            total = 0
            for folder in self.root.iterdir():
                if folder.is_dir():
                    for item in os.scandir(folder):
                        if item.name.endswith(SUFFIX):
                            try:
                                total += item.stat().st_size
                            except FileNotFoundError:
                                continue
            self._held, self._listed_at = total, time.monotonic()
        return self._held

    def stale(self) -> None:
        """The tier changed: the next ``held`` lists it again."""
        self._listed_at = 0.0

    def names(self) -> set[str]:
        try:
            return {n for n in os.listdir(self.dir) if n.endswith(SUFFIX)}
        except FileNotFoundError:
            return set()
