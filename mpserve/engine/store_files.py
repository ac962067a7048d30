"""The host store's files: read bounded, written whole, marked as used (``mpserve.engine.host_store``).

    write_atomic(path, data) ──▶ a new private temporary file (0600, O_EXCL, no link followed) ──fsync?──▶ rename
    read_private(path, most) ──▶ the file of ours at ``path`` (a link is not followed), never more than it holds
    touch(path)              ──▶ its mtime set to now: least recently used is the oldest mtime
    sha256(path)             ──▶ a file's content digest (a GGUF's, part of the store's key)
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

from mpserve.private import create_private, open_private


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_private(path: Path, most: int | None = None) -> bytearray:
    """The bytes of the regular file of ours at ``path`` (not followed if a link), at most ``most``: never more
    than the file has when opened."""
    with os.fdopen(open_private(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = bytearray(size if most is None else min(size, most))
        got = f.readinto(data)
    del data[got:]
    return data


def touch(path: Path) -> None:
    """``path`` is the most recently used now. The time is given, not left to the kernel, whose file times move
    in ticks of a few ms: a file written just before would tie with it."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except OSError:
        pass


def write_atomic(path: Path, data: bytes | bytearray, durable: bool, suffix: str = ".part") -> None:
    """``data`` as ``path``, 0600: a new temporary file in the same folder, renamed (after fsync, if ``durable``)."""
    tmp = path.with_name(f".tmp-{os.getpid()}-{threading.get_ident()}{suffix}")
    tmp.unlink(missing_ok=True)  # a dead writer's that had our pid and thread id
    try:
        with os.fdopen(create_private(tmp, os.O_WRONLY), "wb") as out:
            out.write(data)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, path)
        if durable:
            fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
