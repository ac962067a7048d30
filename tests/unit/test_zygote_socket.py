"""A zygote's listening socket (``mpserve.worker.zygote``): the file it bound is removed when it stops listening,
and only that file: a later zygote of the model that bound the path anew keeps its own. A connection that never
answers the challenge is refused once its time is up, and one that proves the secret is served with no limit."""

from __future__ import annotations

import os
import socket
import threading
from multiprocessing import connection
from pathlib import Path

import pytest

from mpserve.worker import zygote
from mpserve.worker.zygote import _listen, _proven, _unlisten

pytestmark = pytest.mark.timeout(30)


def test_a_zygote_that_stops_listening_removes_its_socket_file(tmp_path: Path) -> None:
    path = str(tmp_path / "z.sock")
    listener = _listen(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    _unlisten(listener, path)
    assert not os.path.exists(path)


def test_it_leaves_the_file_a_later_zygote_bound_at_the_same_path(tmp_path: Path) -> None:
    path = str(tmp_path / "z.sock")
    first = _listen(path)
    second = _listen(path)  # the model's next zygote: the path bound anew
    _unlisten(first, path)
    assert os.path.exists(path)
    _unlisten(second, path)
    assert not os.path.exists(path)


def test_a_connection_that_never_answers_the_challenge_is_refused_in_time(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zygote, "CHALLENGE_TIMEOUT_S", 0.5)
    path = str(tmp_path / "z.sock")
    listener = _listen(path)
    with socket.socket(socket.AF_UNIX) as silent:
        silent.connect(path)  # a process of this user's that says nothing
        assert _proven(listener, b"secret") is None  # without the limit: waits for ever
    _unlisten(listener, path)


def test_a_connection_that_proves_the_secret_is_served_with_no_time_limit(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zygote, "CHALLENGE_TIMEOUT_S", 0.5)
    path = str(tmp_path / "z.sock")
    listener = _listen(path)
    client = connection.Client(path, family="AF_UNIX")
    proving = threading.Thread(target=lambda: (connection.answer_challenge(client, b"secret"),
                                               connection.deliver_challenge(client, b"secret")))
    proving.start()
    conn = _proven(listener, b"secret")
    proving.join()
    assert conn is not None
    timer = threading.Timer(1.0, client.send, args=("after a quiet second",))  # past the challenge's limit
    timer.start()
    assert conn.recv() == "after a quiet second"
    conn.close()
    client.close()
    _unlisten(listener, path)
