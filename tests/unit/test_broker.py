"""The broker's bookkeeping of worker registrations, driven directly (no processes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from mpserve import protocol as wire
from mpserve.server.broker import Broker, WorkerEntry

pytestmark = pytest.mark.timeout(10)


@pytest.fixture
def broker() -> Iterator[Broker]:
    ctx = zmq.Context()
    broker = Broker(ctx, "inproc://front", "inproc://back", {"m": 8})
    yield broker
    broker.front.close(0)
    broker.back.close(0)
    ctx.term()


def test_a_worker_that_loads_on_demand_registers_again_and_counts_as_a_good_load(broker: Broker) -> None:
    seen: list[tuple[int | None, bool]] = []
    broker.on_ready = lambda entry: seen.append((entry.index, entry.loaded))
    ready = wire.Ready("w0", "m", -1, 2, 1234, loaded=False)
    broker._on_ready(b"w0", ready)
    assert seen == [(0, False)] and len(broker.models["m"].free) == 2
    broker._on_ready(b"w0", ready)  # registering again after a silence: nothing new
    assert seen == [(0, False)]
    broker._on_ready(b"w0", wire.Ready("w0", "m", -1, 2, 1234, loaded=True, chat_template="{{ x }}"))
    assert seen == [(0, False), (0, True)]  # the supervisor hears of the good load
    assert len(broker.models["m"].free) == 2 and broker.workers[b"w0"].loaded
    assert broker.snapshot().models["m"].chat_template == "{{ x }}"


def test_a_new_process_under_the_same_name_replaces_the_old_entry(broker: Broker) -> None:
    broker._on_ready(b"w0", wire.Ready("w0", "m", -1, 1, 1234))
    first: WorkerEntry = broker.workers[b"w0"]
    broker._on_ready(b"w0", wire.Ready("w0", "m", -1, 1, 5678))
    assert broker.workers[b"w0"] is not first and broker.workers[b"w0"].pid == 5678
    assert len(broker.models["m"].free) == 1
