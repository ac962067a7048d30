"""This user's folders and files in shared places (``mpserve.private``): made private, and refused, each with the
line that names it and the fix, when a link, another kind of file, another user's, or open to others."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import OTHER_USER

from mpserve.errors import ConfigError
from mpserve.private import (
    FILE_MODE,
    FOLDER_MODE,
    PlantedFile,
    check_private,
    check_private_dir,
    create_private,
    open_private,
    private_dir,
    read_guarded,
)

pytestmark = pytest.mark.timeout(30)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def unblocked(action: Callable[[], object]) -> object:
    """What ``action`` returned or raised, run in a thread that must not block (on a FIFO) for 5 s."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(action())
        except Exception as exc:  # noqa: BLE001 - the outcome, asserted by the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(5)
    assert outcome, "blocked opening a FIFO (a planted one would hang the server)"
    return outcome[0]


def given_away(path: Path, uid: int = OTHER_USER) -> None:
    if os.geteuid() != 0:
        pytest.skip("acting as a second local user needs root (giving a file away)")
    os.chown(path, uid, uid, follow_symlinks=False)


def test_a_folder_and_its_missing_parents_are_made_closed_to_others(tmp_path: Path) -> None:
    folder = tmp_path / "a" / "b"
    assert private_dir(folder, "store folder") == folder
    assert mode(folder) == mode(tmp_path / "a") == FOLDER_MODE == 0o700
    assert private_dir(folder, "store folder") == folder  # there already, and fine


def test_a_folder_that_cannot_be_made_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"cannot create the store folder .*/file/x \(Not a directory\); give a "
                       "folder you can write$"):
        private_dir(tmp_path / "file" / "x", "store folder")


def test_a_link_another_kind_of_file_and_a_folder_open_to_others_are_refused_with_their_fix(tmp_path: Path) -> None:
    real = private_dir(tmp_path / "real", "f")
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ConfigError, match=r"the tier .*/link is a symbolic link; remove it \(rm .*/link\) or give "
                       "the folder it points to$"):
        private_dir(tmp_path / "link", "tier")
    (tmp_path / "plain").write_text("")
    with pytest.raises(ConfigError, match=r"the tier .*/plain is not a folder; remove it \(rm .*/plain\) or give "
                       "another folder$"):
        private_dir(tmp_path / "plain", "tier")
    for opened in (0o770, 0o707, 0o701, 0o710):
        os.chmod(real, opened)
        with pytest.raises(ConfigError, match=rf"is open to other users \(mode {opened:04o}\); close it with: chmod "
                           f"700 {real}$"):
            private_dir(real, "tier")
    with pytest.raises(ConfigError, match=r"cannot use the tier .*/gone \(No such file or directory\)$"):
        check_private_dir(tmp_path / "gone", "tier")


def test_another_users_folder_is_refused_naming_both_users(tmp_path: Path) -> None:
    folder = private_dir(tmp_path / "theirs", "tier")
    given_away(folder)
    with pytest.raises(ConfigError, match=rf"the tier {folder} belongs to user {OTHER_USER}, not to you "
                       rf"\({os.geteuid()}\): another user may read or change what is in it; remove it \(rm -r "
                       rf"{folder}, as root\) or give a folder of yours$"):
        private_dir(folder, "tier")


def test_a_new_file_is_0600_and_never_written_through_a_name_already_there(tmp_path: Path) -> None:
    path = tmp_path / "new"
    fd = create_private(path)
    try:
        assert os.write(fd, b"x") == 1 and mode(path) == FILE_MODE == 0o600
        assert os.get_inheritable(fd) is False
    finally:
        os.close(fd)
    target = tmp_path / "target"
    (tmp_path / "planted").symlink_to(target)
    for there in (path, tmp_path / "planted"):
        with pytest.raises(FileExistsError):
            create_private(there)
    assert not target.exists()


def test_an_existing_file_is_opened_only_as_a_regular_file_of_this_user_s(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.write_bytes(b"ok")
    fd = open_private(mine)
    try:
        assert os.read(fd, 8) == b"ok" and os.get_blocking(fd) and not os.get_inheritable(fd)
    finally:
        os.close(fd)
    check_private(mine)
    (tmp_path / "link").symlink_to(mine)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    with pytest.raises(PlantedFile, match="link is a symbolic link$") as raised:
        open_private(tmp_path / "link")
    assert raised.value.errno == 40  # ELOOP
    with pytest.raises(PlantedFile, match="link is a symbolic link$") as raised:
        check_private(tmp_path / "link")
    assert raised.value.errno == errno.ELOOP
    for planted in ("fifo", "folder"):  # the FIFO is opened without waiting for a writer
        said = f"{tmp_path / planted} is not a regular file of yours"  # the callers show its strerror
        refused = unblocked(lambda: open_private(tmp_path / planted))  # noqa: B023 - called at once
        assert isinstance(refused, PlantedFile) and refused.strerror == said
        with pytest.raises(PlantedFile) as raised:
            check_private(tmp_path / planted)
        assert raised.value.strerror == said
    for absent in (open_private, check_private):
        with pytest.raises(FileNotFoundError):
            absent(tmp_path / "none")


def test_another_users_file_is_planted(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.write_bytes(b"x")
    given_away(theirs)
    with pytest.raises(PlantedFile, match="theirs is not a regular file of yours$"):
        open_private(theirs)
    with pytest.raises(PlantedFile, match="theirs is not a regular file of yours$"):
        check_private(theirs)


def test_a_guarded_file_is_read_unless_others_may_change_it_or_read_a_secret(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_bytes(b"sesame")
    for ok, secret in ((0o600, True), (0o400, True), (0o644, False), (0o640, False), (0o601, False)):
        os.chmod(path, ok)
        assert read_guarded(path, "API key file", secret=secret) == b"sesame"
    for bad, secret, how in ((0o620, False, "changed"), (0o602, False, "changed"), (0o640, True, "read"),
                             (0o604, True, "read"), (0o601, True, "read"), (0o622, True, "changed")):
        os.chmod(path, bad)
        with pytest.raises(ConfigError, match=rf"the API key file {path} may be {how} by other users \(mode "
                           rf"{bad:04o}\); close it: chmod 600 {path}$"):
            read_guarded(path, "API key file", secret=secret)
    os.chmod(path, 0o600)
    (tmp_path / "mounted").symlink_to(path)  # a mounted secret is a link: followed
    assert read_guarded(str(tmp_path / "mounted"), "API key file", secret=True) == b"sesame"
    os.mkfifo(tmp_path / "fifo", 0o600)  # a FIFO nobody writes to: read as empty, never waited on
    assert unblocked(lambda: read_guarded(tmp_path / "fifo", "API key file", secret=True)) == b""


def test_a_guarded_fifo_is_read_to_its_writer_s_end_however_slow(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    writer = os.open(fifo, os.O_RDWR)  # a writer before the reader opens it (without one it reads as empty)
    read: list[bytes] = []
    reader = threading.Thread(target=lambda: read.append(read_guarded(fifo, "API key file", secret=True)),
                              daemon=True)
    reader.start()
    try:
        os.write(writer, b"first ")
        deadline = time.monotonic() + 5
        while unread(writer) and time.monotonic() < deadline:  # the reader takes it, then waits for the rest
            time.sleep(0.01)
        os.write(writer, b"second")
    finally:
        os.close(writer)
    reader.join(5)
    assert read == [b"first second"], f"a FIFO's writer slower than its reader was cut short: {read}"


def unread(fd: int) -> int:
    """The bytes written to the pipe ``fd`` that nobody has read yet."""
    return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0])


def test_a_guarded_file_of_another_user_is_refused_but_root_s_is_read(tmp_path: Path) -> None:
    path = tmp_path / "config"
    path.write_bytes(b"a: 1")
    given_away(path)
    with pytest.raises(ConfigError, match=rf"the configuration file {path} belongs to user {OTHER_USER}, who may "
                       rf"change it; use a file of yours: chown {os.geteuid()} {path} \(as root\), then chmod 600 "
                       rf"{path}$"):
        read_guarded(path, "configuration file")
    given_away(path, 1)  # a system user, not root
    with pytest.raises(ConfigError, match="belongs to user 1, who may change it"):
        read_guarded(path, "configuration file")
    os.chown(path, 0, 0)
    assert read_guarded(path, "configuration file") == b"a: 1"
