"""The HTTP socket an upgrade hands to the next start is taken only in the process that handed it over, and only
when it listens on the very address ``--http`` names (before, an inherited ``MPSERVE_HANDED_HTTP_FD`` made a
start serve a socket on 0.0.0.0 with no API key: the exposure check saw ``--http 127.0.0.1`` and the port alone
was compared)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from helpers import free_port

from mpserve.gateway import fleet

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def handed(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Put a listening socket on HOST:PORT in the environment as ``Fleet.hand_over`` does (``by``: the pid named):
    a descriptor of its own, which ``handed_over`` owns once it looked at it."""
    socks = []

    def hand(host: str, port: int, by: int | None) -> int:
        sock = fleet.listen(host, port)
        socks.append(sock)
        fd = os.dup(sock.fileno())
        monkeypatch.setenv(fleet.HANDED_FD, str(fd))
        monkeypatch.setenv(fleet.HANDED_PIDS, "")
        if by is not None:
            monkeypatch.setenv(fleet.HANDED_BY, str(by))
        return fd

    yield hand
    for sock in socks:
        sock.close()


def test_a_socket_handed_over_in_this_process_on_the_address_named_is_taken(handed) -> None:
    port = free_port()
    fd = handed("127.0.0.1", port, os.getpid())
    taken = fleet.handed_over("127.0.0.1", port)
    assert taken is not None and taken[0].fileno() == fd
    taken[0].close()
    assert fleet.HANDED_FD not in os.environ and fleet.HANDED_BY not in os.environ


def test_a_socket_on_another_host_with_the_same_port_is_not_taken(handed) -> None:
    port = free_port()
    handed("0.0.0.0", port, os.getpid())
    assert fleet.handed_over("127.0.0.1", port) is None


@pytest.mark.parametrize("by", [None, 1], ids=["unnamed", "another-process"])
def test_a_socket_inherited_from_another_process_is_not_taken(handed, by: int | None) -> None:
    port = free_port()
    handed("127.0.0.1", port, by)
    assert fleet.handed_over("127.0.0.1", port) is None


def test_a_start_given_an_inherited_socket_on_0_0_0_0_does_not_serve_it(tmp_path) -> None:
    """``--http 127.0.0.1:PORT`` with no key, and a socket on 0.0.0.0:PORT inherited with the variable: the start
    binds its own (which that socket's port makes fail, with one line) instead of serving everyone."""
    port = free_port()
    sock = fleet.listen("0.0.0.0", port)
    try:
        env = {**os.environ, fleet.HANDED_FD: str(sock.fileno()), fleet.HANDED_PIDS: ""}
        run = subprocess.run([sys.executable, "-m", "mpserve", "start", "--server-name", f"handed-{port}", "--model",
                              "echo", "--http", f"127.0.0.1:{port}"], env=env, pass_fds=(sock.fileno(),),
                             capture_output=True, text=True, timeout=50)
    finally:
        sock.close()
    assert run.returncode == 1, run.stderr
    assert f"--http 127.0.0.1:{port}: cannot listen" in run.stderr.splitlines()[-1], run.stderr
