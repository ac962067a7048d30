"""A broker driven directly, on inproc sockets (no processes): the fixture the unit tests of its rules share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from mpserve.server.broker import Broker


@pytest.fixture(name="broker")
def broker_fixture() -> Iterator[Broker]:
    """A broker of one model, "m" (queue 8), without an admin socket (``test_broker`` has its own, with one)."""
    ctx = zmq.Context()
    broker = Broker(ctx, "inproc://front", "inproc://back", {"m": 8})
    yield broker
    broker.front.close(0)
    broker.back.close(0)
    ctx.term()
