"""The server's side of a zygote's adoption (``mpserve.server.adoption.adopt_zygote``): a zygote that goes quiet in
the middle of the challenge, or goes away before it is told the new start's secret, is given up within the time
limit and the start goes on; one that proves itself, runs this code and holds these weights is adopted.

    test thread: a fake zygote at z.sock (a real socket, multiprocessing's challenge) ◀──connect── adopt_zygote
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from multiprocessing import connection
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from mpserve.server import adoption
from mpserve.worker.spec import EngineSpec, revision

pytestmark = pytest.mark.timeout(30)

SECRET = b"the dead server's secret"
ENGINE = EngineSpec("/models/m.gguf", n_ctx=256, threads=1, n_gpu_layers=0)


@pytest.fixture
def fake_zygote(tmp_path: Path) -> Iterator[Callable[[Callable[[Connection], None]], Path]]:
    """``fake_zygote(act)``: a socket at a path of its own whose one connection ``act`` is given (in a thread) once
    accepted; the path. The thread is joined after the test."""
    threads: list[threading.Thread] = []
    listeners: list[socket.socket] = []

    def start(act: Callable[[Connection], None]) -> Path:
        path = tmp_path / f"z{len(listeners)}.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(1)
        listeners.append(listener)

        def serve() -> None:
            sock, _ = listener.accept()
            with Connection(sock.detach()) as conn:
                act(conn)

        threads.append(threading.Thread(target=serve, daemon=True))
        threads[-1].start()
        return path

    yield start
    for thread in threads:
        thread.join(10)
    for listener in listeners:
        listener.close()


def _adopt(path: Path) -> object:
    return adoption.adopt_zygote("m", ENGINE, path, (SECRET.decode(),), proof="this start's secret")


def test_a_zygote_that_goes_quiet_in_the_middle_of_the_challenge_is_given_up_in_time(
        fake_zygote: Callable[[Callable[[Connection], None]], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adoption, "CHALLENGE_TIMEOUT_S", 0.5)
    done = threading.Event()

    def quiet(conn: Connection) -> None:  # proves itself, then never answers the server's challenge
        connection.deliver_challenge(conn, SECRET)
        done.wait(20)

    path = fake_zygote(quiet)
    try:
        assert _adopt(path) is None  # without the limit: waits for ever, and so does the start's loop
    finally:
        done.set()


def _dies_once_proven(conn: Connection) -> None:
    connection.deliver_challenge(conn, SECRET)
    connection.answer_challenge(conn, SECRET)  # and its end closes as it returns: EOF where "adopted" was due


def _stops_reading_once_it_said_who_it_is(conn: Connection) -> None:
    connection.deliver_challenge(conn, SECRET)
    connection.answer_challenge(conn, SECRET)
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.shutdown(socket.SHUT_RD)  # before it speaks: the new secret, sent after, cannot be written (EPIPE)
    conn.send(("adopted", os.getpid(), revision(), asdict(ENGINE)))


@pytest.mark.parametrize("zygote", [_dies_once_proven, _stops_reading_once_it_said_who_it_is])
def test_a_zygote_gone_in_the_middle_of_its_adoption_is_given_up_and_the_start_goes_on(
        fake_zygote: Callable[[Callable[[Connection], None]], Path], zygote: Callable[[Connection], None]) -> None:
    assert _adopt(fake_zygote(zygote)) is None  # before: EOFError, BrokenPipeError out of the supervisor's start_all


def test_a_zygote_that_proves_itself_and_holds_these_weights_is_adopted_and_told_the_new_secret(
        fake_zygote: Callable[[Callable[[Connection], None]], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adoption, "CHALLENGE_TIMEOUT_S", 0.2)
    told: list[object] = []

    def adopted(conn: Connection) -> None:
        connection.deliver_challenge(conn, SECRET)
        connection.answer_challenge(conn, SECRET)
        conn.send(("adopted", os.getpid(), revision(), asdict(ENGINE)))
        told.append(conn.recv())
        time.sleep(1.0)  # not a wait: quiet for longer than the challenge's limit, as an adopted zygote may be
        conn.send(("exited", 1, 0))

    zygote = _adopt(fake_zygote(adopted))
    assert isinstance(zygote, adoption.Zygote) and zygote.process.pid == os.getpid()
    try:
        assert zygote._conn.recv() == ("exited", 1, 0)  # a read with the limit still on fails after 0.2 s
        assert told == ["this start's secret"]
    finally:
        zygote._conn.close()
        zygote.process.close()
