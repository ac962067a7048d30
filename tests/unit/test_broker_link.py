"""A worker's link to its broker (``mpserve.worker.link``): its clocks and its watch of the server, on a real
socket and a real child process as the server."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from mpserve.worker.link import ORPHAN_RETRY_S, REGISTER_BACKOFF_FIRST_S, REGISTER_BACKOFF_MAX_S, BrokerLink
from mpserve.worker.spec import EngineSpec, WorkerSpec

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def server() -> Iterator[subprocess.Popen[bytes]]:
    """A process standing for the worker's server: it runs until the test ends it."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def link(server: subprocess.Popen[bytes]) -> Iterator[BrokerLink]:
    ctx = zmq.Context()
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    spec = WorkerSpec(0, "echo", EngineSpec("echo", 512, 1, 0), -1, "inproc://broker", "slots", server.pid,
                      heartbeat_interval=1.0, heartbeat_liveness=3, adopt_wait=10.0)
    sock.connect(spec.backend)
    yield BrokerLink(spec, sock, zmq.Poller())
    sock.close(linger=0)
    ctx.term()


def test_a_heartbeat_goes_out_once_an_interval_and_none_while_orphaned(link: BrokerLink) -> None:
    assert link.heartbeat_due(100.0) and not link.heartbeat_due(100.5) and link.heartbeat_due(101.0)
    link.orphaned(reconnect=True)
    assert not link.heartbeat_due(200.0)


def _tries(link: BrokerLink, since: float, count: int) -> list[float]:
    """The times, from ``since`` on in steps of 0.05 s, at which a silent link registers again: ``count`` of them."""
    tries: list[float] = []
    at = since
    while len(tries) < count:
        if link.register_due(at, silent=True):
            tries.append(at)
        at += 0.05
    return tries


def _gaps(tries: list[float]) -> list[float]:
    return [b - a for a, b in zip(tries, tries[1:], strict=False)]


def test_a_silent_broker_is_registered_with_again_backed_off_and_a_word_from_it_resets_the_backoff(
        link: BrokerLink) -> None:
    start = time.monotonic()
    assert link.silent_for(start) is None
    late = start + 3.5  # past interval × liveness (3 s)
    assert link.silent_for(late) == pytest.approx(3.5, abs=0.5)
    gaps = _gaps(_tries(link, late, 6))
    backoffs = [min(REGISTER_BACKOFF_MAX_S, REGISTER_BACKOFF_FIRST_S * 2 ** (k + 1)) for k in range(len(gaps))]
    assert all(0.5 * b - 0.06 <= gap <= 1.5 * b + 0.06 for gap, b in zip(gaps, backoffs, strict=True)), (gaps, backoffs)
    link.heard()
    assert link.silent_for(time.monotonic()) is None
    after = _tries(link, late + 100.0, 2)  # once the try already planned has gone, the backoff's first steps again
    assert _gaps(after)[0] <= 1.5 * 2 * REGISTER_BACKOFF_FIRST_S + 0.06, after


def test_told_it_is_unknown_it_registers_at_once_and_once(link: BrokerLink) -> None:
    assert not link.register_due(0.0, silent=False)
    link.must_register = True
    assert link.register_due(0.0, silent=False)
    link.registering()
    assert link.registered and not link.register_due(0.0, silent=False)


def test_the_server_watched_is_seen_gone_and_an_orphan_waits_for_the_next_start(
        link: BrokerLink, server: subprocess.Popen[bytes]) -> None:
    assert not link.server_gone()
    server.kill()
    server.wait()
    assert link.server_gone()
    link.orphaned(reconnect=True)
    assert link.orphaned_now and link.must_register and link.orphan_until is not None
    now = time.monotonic()
    assert link.silent_for(now + ORPHAN_RETRY_S + 0.1) is not None  # its own bound, shorter than interval × liveness
    with subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE) as next_start:
        link.adopted(next_start.pid)
        assert not link.orphaned_now and not link.server_gone()
        next_start.kill()
