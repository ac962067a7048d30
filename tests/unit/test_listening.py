"""``runtime.listening``: whether anything listens on a unix socket, told at once (a client connecting to a server
that died is refused there, not left waiting for a ping's answer)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from mpserve.runtime import listening

pytestmark = pytest.mark.timeout(10)


def test_a_listener_a_socket_file_left_behind_and_no_file(tmp_path: Path) -> None:
    path = str(tmp_path / "server.sock")
    assert not listening(path)  # no file
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    assert listening(path)
    server.close()  # a process that died: its socket file stays, nothing listens
    assert Path(path).exists() and not listening(path)


def test_a_full_backlog_counts_as_listening(tmp_path: Path) -> None:
    path = str(tmp_path / "busy.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(0)
    waiting = []
    try:
        while True:  # fill the backlog: the next connection would wait for an accept
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            peer.setblocking(False)
            waiting.append(peer)
            try:
                peer.connect(path)
            except BlockingIOError:
                break
        assert listening(path)
    finally:
        for peer in waiting:
            peer.close()
        server.close()
