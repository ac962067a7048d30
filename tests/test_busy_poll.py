"""The broker's busy polling end to end (``mpserve.server.waiting``): requests one at a time from a raw DEALER
(the case polling is for) with it on and off, and an idle broker that has stopped polling."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from conftest import ServerProcess
from helpers import dealer, received

from mpserve.wire import protocol as wire

REQUESTS = 2000
IDLE_S = 2.0


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds of ``pid``, every thread."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _one_at_a_time(address: str, n: int) -> None:
    params = wire.GenerateParams(max_tokens=1, temperature=0.0)
    with dealer(address) as sock:
        for i in range(n):
            sock.send_multipart(wire.encode(wire.Request(f"r{i}", "ping", None, params)))
            reply = received(sock, 10)
            assert isinstance(reply, wire.Done) and reply.id == f"r{i}", reply


@pytest.mark.timeout(60)
@pytest.mark.parametrize("busy_poll_us", ["250", "0"])
def test_requests_one_at_a_time_are_served_and_the_idle_broker_does_not_poll(
        start_server: type[ServerProcess], busy_poll_us: str) -> None:
    server = start_server("--model", "echo", "--busy-poll-us", busy_poll_us, "--log-level", "debug").wait_ready()
    _one_at_a_time(server.address, REQUESTS)
    before = _cpu_s(server.proc.pid)
    time.sleep(IDLE_S)  # not a wait: the idle time whose CPU use is measured
    used = _cpu_s(server.proc.pid) - before
    assert used < 0.2 * IDLE_S, f"the idle broker used {used:.2f} s of CPU in {IDLE_S:g} s"
    flips = [line for line in server.log if "busy polling" in line]
    if busy_poll_us == "0":
        assert not flips  # no guard runs at all
    elif not any("busy polling on" in line for line in flips):
        pytest.skip(f"busy polling never went on (the host had no CPU to spare, or the answers came later than "
                    f"{busy_poll_us} µs): {flips[-1:] or 'no guard verdict'}")
