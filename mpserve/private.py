"""This user's folders and files in shared places (/dev/shm, /tmp, the permit lock folder, the host store's tiers):
made private, checked before use, opened without following links, as PostgreSQL treats its data folder.

    private_dir(path) ──mkdir 0700──▶ lstat: a real folder, ours, closed to others ──▶ path
                                      else ConfigError: one line naming the folder and the fix
    create_private(path) ──O_CREAT|O_EXCL|O_NOFOLLOW, 0600──▶ a descriptor of a new file (never a planted one)
    open_private(path) ──O_NOFOLLOW, fstat: a regular file, ours──▶ a descriptor, or PlantedFile
    read_guarded(path) ──open, fstat: owned by us or root, nobody else may write it (nor read it, a secret's)──▶
                         its bytes; else ConfigError: one line naming the file and the fix (an API key file, the
                         configuration file: another user who may change them would let itself in)

Another local user can create a name in a sticky folder like /dev/shm before us (the names are predictable): a
folder that is not ours, or that others may write, could then be swapped, read or filled by them, and a link
would make us write through it into a file of the link maker's choice. So a folder is used only when its owner
is this process's user and its mode opens nothing to others, and a file is opened only as itself.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from mpserve.errors import ConfigError

FOLDER_MODE = 0o700
FILE_MODE = 0o600


class PlantedFile(OSError):
    """A name that is not a regular file of this user's: a link, a folder, a device, another user's file."""


def private_dir(path: Path, what: str) -> Path:
    """``path`` as a folder of this user's that nobody else may enter (made 0700 if missing, with its missing
    parents); ``what`` names it in the ``ConfigError`` that refuses it otherwise."""
    missing = []
    folder = path
    while not os.path.lexists(folder):
        missing.append(folder)
        folder = folder.parent
    try:
        for folder in reversed(missing):
            with contextlib.suppress(FileExistsError):  # made by another process meanwhile: checked below
                os.mkdir(folder, FOLDER_MODE)
    except OSError as exc:
        raise ConfigError(f"cannot create the {what} {path} ({exc.strerror}); give a folder you can write") from None
    check_private_dir(path, what)
    return path


def check_private_dir(path: Path, what: str) -> None:
    """Refuse ``path`` (``ConfigError``) unless it is a real folder, owned by this user, closed to others."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise ConfigError(f"cannot use the {what} {path} ({exc.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"the {what} {path} is a symbolic link; remove it (rm {path}) or give the folder it "
                          "points to")
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"the {what} {path} is not a folder; remove it (rm {path}) or give another folder")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"the {what} {path} belongs to user {st.st_uid}, not to you ({os.geteuid()}): another "
                          f"user may read or change what is in it; remove it (rm -r {path}, as root) or give a "
                          "folder of yours")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise ConfigError(f"the {what} {path} is open to other users (mode {stat.S_IMODE(st.st_mode):04o}); close "
                          f"it with: chmod 700 {path}")


def create_private(path: Path, flags: int = os.O_RDWR) -> int:
    """A descriptor of a new file at ``path``, mode 0600; ``FileExistsError`` if any name is there, a link
    included (nothing planted is ever written through)."""
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)


def check_private(path: Path) -> None:
    """``path`` is a regular file of this user's, not a link (``PlantedFile`` otherwise, ``FileNotFoundError`` if
    there is none), checked without opening it: for a file another part of this process may hold open with POSIX
    locks (an SQLite database), which closing any descriptor of it would release."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise PlantedFile(errno.ELOOP, f"{path} is a symbolic link")
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise PlantedFile(0, f"{path} is not a regular file of yours")


def open_private(path: Path, flags: int = os.O_RDONLY) -> int:
    """A descriptor of the existing file at ``path`` when it is a regular file of this user's (not followed if a
    link); ``PlantedFile`` otherwise, ``FileNotFoundError`` if there is none."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)  # O_NONBLOCK: a planted FIFO
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise PlantedFile(exc.errno, f"{path} is a symbolic link") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise PlantedFile(0, f"{path} is not a regular file of yours")
    os.set_blocking(fd, True)
    return fd


def read_guarded(path: str | os.PathLike[str], what: str, secret: bool = False) -> bytes:
    """The bytes of the file at ``path`` (a link is followed: a mounted secret is one), checked once opened: a
    regular file that a user other than this one or root owns, or that others may write, or with ``secret`` read, is
    refused with ``ConfigError`` (``what`` names it); ``OSError`` if it cannot be read."""
    with open(os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK), "rb") as file:  # O_NONBLOCK: a FIFO
        st = os.fstat(file.fileno())
        if stat.S_ISREG(st.st_mode):
            _check_guarded(path, what, st, secret)
        os.set_blocking(file.fileno(), True)
        return file.read()


def _check_guarded(path: str | os.PathLike[str], what: str, st: os.stat_result, secret: bool) -> None:
    mode, me = stat.S_IMODE(st.st_mode), os.geteuid()
    if st.st_uid not in (me, 0):
        raise ConfigError(f"the {what} {path} belongs to user {st.st_uid}, who may change it; use a file of yours: "
                          f"chown {me} {path} (as root), then chmod 600 {path}")
    if mode & (0o077 if secret else 0o022):
        open_to = "changed" if mode & 0o022 else "read"
        raise ConfigError(f"the {what} {path} may be {open_to} by other users (mode {mode:04o}); close it: "
                          f"chmod 600 {path}")
