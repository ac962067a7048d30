"""Where preemption meets tenants and adapters in the broker, with fake workers: a victim cancelled while its
PREEMPT goes, a victim whose worker dies meanwhile, a tenant at its max_running across two models, an urgent
request naming an adapter one instance has not loaded. Each keeps the counts (slots, the tenant's running
requests) and the queues right."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import zmq
from brokers import broker_fixture  # noqa: F401  (the fixture "broker")
from test_broker import peers, taken

from mpserve.config.tenants import Tenant, Tenants
from mpserve.server.broker import Broker
from mpserve.server.state import Pending
from mpserve.wire import protocol as wire
from mpserve.wire.adapters import Served

pytestmark = pytest.mark.timeout(30)


def _request(client: zmq.Socket[bytes], broker: Broker, rid: str, priority: int, **fields: Any) -> None:
    client.send_multipart(wire.encode(wire.Request(rid, "hi", stream=True, priority=priority, **fields)))
    accepted = broker.tables.stats["accepted"]
    while broker.tables.stats["accepted"] == accepted:
        assert broker.front.poll(1000)
        broker.drain_front()


def _answer(broker: Broker, rid: str, mtype: wire.MsgType, body: Any) -> None:
    p = next(p for p in broker.tables.requests.values() if p.request.id == rid)
    assert p.worker is not None
    broker.results.result(p.worker, mtype, p.ticket, wire.TYPE_FRAMES[mtype], wire.pack(body), None)


def _done(broker: Broker, rid: str) -> None:
    _answer(broker, rid, wire.MsgType.DONE, wire.Done(rid, "x", "stop", wire.Usage(1, 1), wire.Timings(0, 0, 0)))


def _preempting(client: zmq.Socket[bytes], broker: Broker, workers: dict[bytes, zmq.Socket[bytes]]) -> Pending:
    """Two requests of priority 0 in the two slots, then one of priority 10: the victim its PREEMPT went to."""
    _request(client, broker, "a", 0)
    _request(client, broker, "b", 0)
    taken(workers)
    _request(client, broker, "urgent", 10)
    return next(p for p in broker.tables.requests.values() if p.preempting)


def test_a_victim_cancelled_while_its_preempt_goes_leaves_its_tenant_s_count(broker: Broker) -> None:
    with peers(broker, slots=1) as (client, workers):
        victim = _preempting(client, broker, workers)
        client.send_multipart(wire.encode(wire.Cancel(victim.request.id)))
        assert broker.front.poll(1000)
        broker.drain_front()
        assert victim.answered
        _answer(broker, victim.request.id, wire.MsgType.PARKED, wire.Parked(victim.request.id))
        assert broker.tables.ledger.running("") == 2  # the other low one and the urgent one, not the cancelled victim


def test_a_victim_whose_worker_dies_before_it_parks_gives_its_next_slot_back(broker: Broker) -> None:
    with peers(broker, slots=1) as (client, workers):
        victim = _preempting(client, broker, workers)
        lost = victim.worker
        assert lost is not None
        broker.worker_exited(int(lost[1:]), 0)
        broker.registry.register(lost, wire.Ready(lost.decode(), "m", -1, 1, 2, proof=broker.link_secret), None)
        broker.flush()
        for _ in range(3):  # every request to its end, one at a time as slots free
            running = next((p for p in broker.tables.requests.values() if p.worker is not None), None)
            if running is not None:
                _done(broker, running.request.id)
        assert not broker.tables.requests and len(broker.tables.models["m"].free) == 2


def test_a_tenant_at_its_max_running_starts_on_another_model_once_one_ends() -> None:
    ctx = zmq.Context()
    broker = Broker(ctx, "inproc://front2", "inproc://back2", {"m": 8, "n": 8},
                    tenants=Tenants({}, Tenant(max_running=1, max_priority=100)))
    client = ctx.socket(zmq.DEALER)
    client.connect("inproc://front2")
    with contextlib.ExitStack() as sockets:
        sockets.callback(client.close, 0)
        for name, model in ((b"w0", "m"), (b"w1", "n")):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, name)
            sock.connect("inproc://back2")
            sockets.callback(sock.close, 0)
            broker.registry.register(name, wire.Ready(name.decode(), model, -1, 2, 1, proof=broker.link_secret), None)
        _request(client, broker, "on-m", 0, model="m")
        _request(client, broker, "on-n", 0, model="n")  # its tenant is at max_running 1: it waits
        assert len(broker.tables.models["n"].queue) == 1
        _done(broker, "on-m")
        assert len(broker.tables.models["n"].queue) == 0  # started once the tenant's other request ended
    broker.front.close(0)
    broker.back.close(0)
    ctx.term()


def test_an_urgent_request_preempts_only_where_its_adapters_are_loaded(broker: Broker) -> None:
    broker.tables.models["m"].adapters = Served(["x"])
    with peers(broker, slots=1) as (client, workers):
        broker.tables.workers[b"w0"].adapters = frozenset({"x"})  # w1 registered before a runtime load reached it
        _request(client, broker, "a", 0)
        _request(client, broker, "b", 0)
        taken(workers)
        _request(client, broker, "urgent", 10, adapters=(("x", 1.0),))
        urgent = next(p for p in broker.tables.requests.values() if p.request.id == "urgent")
        assert urgent.worker is None or "x" in broker.tables.workers[urgent.worker].adapters
