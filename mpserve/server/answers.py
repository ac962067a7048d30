"""Every request ends in exactly one terminal message to its client: the answers, and the clients' outbox.

    a manager's verdict ─▶ answer_error(p, code) ─▶ ERROR to p's client (once: ANSWERED), its other choices end
                          │                          with it ─▶ finish(p) once no worker holds it
                          └ cancel(p, code) ─▶ the same, and CANCEL to the worker running it (its late reply only
                                               frees the slot)
    finish(p) ─▶ p leaves the tables: its id is free again (after its last choice), its client's counts drop, a
                 sequence parked for it is forgotten on its worker
    to_client(frames) ─▶ front or admin ROUTER, never blocking: a client not reading ─▶ drop_client: its
                         requests end, nothing more is sent to it; a client gone ─▶ detached: nothing more is sent
                         to it, its requests run on for another client to take up (``mpserve.server.rebind``)

A worker's lookups (TOKENIZE, EMBED, SLOT_ACTION) end here too when their worker is lost (``lookups_lost``). The
slot a request leaves is charged to its tenant here (``left_slot``, ``used``: ``mpserve.server.tenants``).
"""

from __future__ import annotations

import logging
import time

import zmq

from mpserve.errors import ErrorCode
from mpserve.wire import protocol as wire
from mpserve.wire import zmqio

from . import roles
from .state import Pending, RequestState
from .tables import MAX_RETRY_AFTER_S, Tables, WorkerOutbox, cap_key

log = logging.getLogger("mpserve.broker")


class Answers:
    """The terminal messages, and what a request's end changes in the tables."""

    def __init__(self, tables: Tables, outbox: WorkerOutbox, front: zmq.Socket[bytes],
                 admin: zmq.Socket[bytes] | None) -> None:
        self.tables = tables
        self.outbox = outbox
        self.front = front
        self.admin = admin

    def to_client(self, client: bytes, frames: list[bytes]) -> bool:
        """Send without blocking. A client that is not reading loses its requests; one that is gone is detached:
        its requests run on a while for another client of its tenant to take them up (``mpserve.server.rebind``)."""
        if client in self.tables.detached:
            return False
        try:
            if roles.is_admin(client):
                assert self.admin is not None
                zmqio.send(self.admin, [roles.routing_id(client), *frames], zmqio.NOBLOCK)
            else:
                zmqio.send(self.front, [client, *frames], zmqio.NOBLOCK)
            return True
        except zmq.Again:
            self.tables.stats["client_not_reading"] += 1
            log.warning("client %s is not reading; cancelling its requests", client.hex())
            self.drop_client(client)
            return False
        except zmq.ZMQError:
            self.tables.stats["client_gone"] += 1
            log.info("client %s is gone; its requests run on for another client to take them up", client.hex())
            self.tables.detached[client] = time.monotonic()
            return False

    def drop_client(self, client: bytes, why: str = "") -> None:
        """Stop everything a client asked for. A client that only went silent gets an ERROR ``why`` per request,
        which ends them if it comes back; to one that is gone or not reading (no ``why``) nothing more is sent."""
        for (owner, _), ticket in list(self.tables.by_client.items()):
            p = self.tables.requests.get(ticket)
            if owner == client and p is not None and not p.answered:
                self.tables.stats["cancelled_client_gone"] += 1
                if why:  # its other choices end with it
                    self.cancel(p, ErrorCode.CANCELLED, why)
                for choice in [c for c in self.tables.choices(p) if not c.answered]:
                    choice.state = RequestState.ANSWERED  # nothing more can reach it
                    self.cancel(choice, ErrorCode.CANCELLED, "client gone")

    def cancel(self, p: Pending, code: str, message: str) -> None:
        """End a request now with ERROR ``code``; a running one is also stopped on its worker."""
        if p.worker is None:
            queue = self.tables.models[p.model].queue
            if p.ticket in queue:
                queue.remove(p.ticket)
            self.answer_error(p, code, message)
        else:
            self.answer_error(p, code, message)  # the worker's late reply only frees the worker
            self.outbox.to_worker(p.worker, wire.Cancel(p.ticket))

    def answer_error(self, p: Pending, code: str, message: str, retry_after: float | None = None) -> None:
        if not p.answered:
            p.state = RequestState.ANSWERED
            self.to_client(p.client, wire.encode(wire.Error(p.request.id, code, message, retry_after)))
            self.end_other_choices(p, code, message)
        if p.worker is None:
            self.finish(p)

    def end_other_choices(self, p: Pending, code: str, message: str) -> None:
        """``p`` was answered with an error: the other choices of its request end with it, unanswered."""
        for other in self.tables.choices(p):
            if other is not p and not other.answered:
                other.state = RequestState.ANSWERED
                self.cancel(other, code, message)

    def finish(self, p: Pending) -> None:
        self.tables.requests.pop(p.ticket, None)
        self.tables.let_go(p)
        self.tables.journal.end(p)
        self.unpark(p)
        key = (p.client, p.request.id)
        left = self.tables.choices(p) if p.group else []
        if left:  # a request for n: its id stays in use until its last choice is done
            self.tables.by_client[key] = left[0].ticket
        else:
            self.tables.unbind(p.client, p)
        capped = cap_key(p.client, p.tenant)
        left_capped = self.tables.capped.get(capped, 0) - 1
        if left_capped > 0:
            self.tables.capped[capped] = left_capped
        else:
            self.tables.capped.pop(capped, None)
        owned = self.tables.owned.get(p.client, 0) - 1
        if owned > 0:
            self.tables.owned[p.client] = owned
        else:
            self.tables.owned.pop(p.client, None)
            self.tables.heard.pop(p.client, None)
            self.tables.spoke.pop(p.client, None)

    def unpark(self, p: Pending) -> None:
        """``p`` ends while parked: its worker forgets its sequence."""
        if p.parked_on is None:
            return
        entry = self.tables.workers.get(p.parked_on)
        p.parked_on = None
        if entry is not None:
            entry.parked.discard(p.ticket)
            self.outbox.to_worker(entry.identity, wire.Cancel(p.ticket))

    def left_slot(self, p: Pending) -> None:
        """``p`` no longer holds its slot (it ended, or its worker was lost): its tenant's running count drops, and
        its tenant is charged the slot time it used beyond (or short of) its cost."""
        p.worker = None
        self.tables.ledger.stopped(p.tenant)
        self.tables.models[p.model].queue.charge(p.tenant, time.monotonic() - p.assigned - p.cost)

    def used(self, p: Pending, done: bytes) -> None:
        """``p`` ended with DONE ``done``: its tokens count for its tenant."""
        usage = wire.peek_usage(done)
        if usage is not None:
            self.tables.ledger.used(p.tenant, usage.prompt_tokens, usage.completion_tokens, time.monotonic())

    def unserved(self, p: Pending, message: str) -> None:
        """End queued ``p``, whose model no instance serves: ERROR ``no_instance`` with ``message``."""
        queue = self.tables.models[p.model].queue
        if p.ticket in queue:  # not the other choices of a request for n: they wait with the first
            queue.remove(p.ticket)
        self.tables.stats[ErrorCode.NO_INSTANCE] += 1
        self.answer_error(p, ErrorCode.NO_INSTANCE, message, retry_after=MAX_RETRY_AFTER_S)

    def lookups_lost(self, identity: bytes, what: str) -> None:
        for ticket, (client, rid, worker) in list(self.tables.lookups.items()):
            if worker == identity:
                del self.tables.lookups[ticket]
                self.to_client(client, wire.encode(wire.Error(rid, ErrorCode.WORKER_LOST, f"{what}; retry")))
