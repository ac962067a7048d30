"""The broker: one event loop that routes requests from clients to free worker slots. It is a composition, floors of
managers over shared tables (as mini-sglang composes its scheduler); this module is the root that owns the sockets,
the deadlines and the server's verbs (drain, roll, hand-off), and takes its hooks as one object at construction.

    clients ──DEALER──▶ front ROUTER ─┐                  ┌─ back ROUTER ◀──DEALER── workers
    operators ────────▶ admin ROUTER ─┤                  │
                                      ▼                  ▲
    Broker (root: sockets, deadlines, heartbeats, drain, roll, hand-off, STATS)  ◀── BrokerHooks (``hooks``)
      │ drain_front, drain_admin                         │ drain_back
      ▼                                                  ▼
    Clients (``clients``: admission, tenants,        Registry (``registry``: READY and trust, loss and retry)
      lookups, reattach)                               │ results: Results (``results``: CHUNK, STEP, DONE, ERROR)
      │ adapter calls: AdapterOps (``adapter_ops``)    │
      │ adoptees' requests: Adopter (``adopter``)      │
      ▼                                                ▼
    Dispatcher (``dispatch``: routing to slots, adapter batching, preemption, parking, drain, hand-over)
      ▼
    Answers (``answers``: each request's one terminal message; the clients' outbox)
      ▼
    Tables (``tables``: requests, workers, models, lookups, clients' counts, stats; the workers' outbox)

Each floor imports only the floors under it. A request's life (``mpserve.server.state`` draws its states):

    validate ─▶ per-model queue ───────▶ assign to a free slot of that model (the one whose last prompt shares the
                                         longest prefix, or whose instance's host store holds it; else one of the
                                         least busy instance: ``routing``)
        CHUNK/DONE/ERROR bodies ◀─────── forwarded unchanged, looked up by ticket
    a queue by priority, then tenants' fair shares (``tenants``); when requests wait and no slot is free, running
    requests of lower priority are preempted (``preemption``): PREEMPT, then the waiting request's ASSIGN into that
    slot ─▶ the worker parks one and admits the other ─▶ PARKED: the preempted one queued again, resumed there

        STEP (one worker step)    ──▶ in order; per client, the step's CHUNK bodies spliced into one CHUNKS
        ASSIGNs of one turn       ──▶ per worker, gathered and sent as one ASSIGNS (``flush``, at the end of each
                                      drain and of each loop turn; before anything else sent to that worker)
        what a restart needs      ──▶ the journal's records of the turn, one write (``journal``, at ``flush``)

    n choices ─▶ n rows in ``requests``, one per choice, queued as one: it starts once n slots of one instance are
                 free (``routing.choose_slots``); the first ERROR of any answers the request
    TOKENIZE, EMBED, SLOT_ACTION ─▶ at once to one instance (``lookups``), its answer taken from that worker only
    admin ROUTER ─▶ the same handling, as an operator: CONTROL and SLOT_ACTION come only this way (``roles``)

Every accepted request ends with exactly one terminal message to its client (DONE or ERROR). A request whose
``timeout`` passes ends ``timeout``; a queued one whose model has no instance registered or loading for
``no_instance_timeout`` ends ``no_instance`` saying why (``unserved``). The broker never blocks on a client: sends
are non-blocking, and a client that cannot take a message has its requests cancelled.

At debug level the broker logs each request as it is queued and each start on a worker, in the order it handles
them: the order of its decisions, which no client's clock can reconstruct.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

from mpserve.config.tenants import Tenants
from mpserve.errors import ErrorCode
from mpserve.wire import protocol as wire
from mpserve.wire import zmqio

from . import journal, roles, unserved
from .adapter_ops import AdapterOps
from .adopter import Adopter
from .answers import Answers
from .clients import Clients
from .dispatch import Dispatcher
from .hooks import BrokerHooks
from .journal import Journal
from .pool_keys import PoolKey
from .registry import Registry
from .residency import Residency
from .results import Results
from .tables import Tables, WorkerOutbox
from .tenants import Ledger

log = logging.getLogger("mpserve.broker")

DRAIN_BATCH = 256
LAST_WORDS_S = 0.5  # the most a cleanly exited worker's last messages are waited for (``worker_exited``)


class Broker:
    """The root of the broker's floors: the sockets, the deadlines, and the verbs the server's loop calls."""

    def __init__(self, ctx: zmq.Context[Any], front_addr: str, back_addr: str, models: dict[str, int], *,
                 max_queue_total: int = 4096, max_pending_per_client: int = 128, client_timeout: float = 5.0,
                 curve_secret: str | None = None, curve_workers: str | None = None,
                 residency: Residency | None = None, heartbeat_interval: float = 1.0,
                 heartbeat_liveness: int = 5, embedding_models: frozenset[str] = frozenset(),
                 admin_addr: str | None = None, curve_admins: str | None = None,
                 no_instance_timeout: float = unserved.DEFAULT_TIMEOUT_S,
                 chat_templates: dict[str, str] | None = None, pool_keys: dict[str, PoolKey] | None = None,
                 tenants: Tenants | None = None, hooks: BrokerHooks | None = None) -> None:
        """``models``: name -> max queue length. ``client_timeout``: a client with pending requests that
        sends nothing for this long is taken as gone and its requests are cancelled (clients ping every
        second while they wait). ``curve_secret``: the server's CURVE secret-key file for the front.
        ``residency``: single active backend mode (at most one model loaded per device).
        ``curve_workers``: with ``curve_secret``, the folder of allowed worker keys; the worker socket then
        requires CURVE too. Remote workers silent for ``heartbeat_interval × heartbeat_liveness`` are lost.
        ``embedding_models``: the models configured ``embedding: true``, which serve EMBED and no REQUEST.
        ``admin_addr``: the operators' socket (``mpserve.server.roles``; None: none, so no operator's call is
        taken), with CURVE when ``curve_admins`` (their keys) is given. ``no_instance_timeout``: how long a
        queued request waits while no instance of its model is registered or loading (``mpserve.server.unserved``).
        ``chat_templates``: the template each model
        is served with by the server's configuration (``layout.served_template``), which a remote pool's must equal
        (``mpserve.server.chat``); a model not in it takes no pool's. ``pool_keys``: the remote pools' keys whose
        models are limited (``mpserve.server.pool_keys``), by their public key in Z85.
        ``tenants``: the ``tenants`` section (``mpserve.server.tenants``; None: one share, no limits).
        ``hooks``: what the broker tells the server and asks of it (``mpserve.server.hooks``; None: nobody)."""
        self.front = _router(ctx, front_addr, curve_secret, b"clients")
        self.back = _router(ctx, back_addr, curve_secret if curve_workers else None, b"workers")
        self.admin = _router(ctx, admin_addr, curve_secret if curve_admins else None, b"admins") if admin_addr else None
        if admin_addr:
            roles.owner_only(admin_addr)
        # no ROUTER_HANDOVER: a connection under a connected worker's name gets none of its messages
        # (``mpserve.server.link``); ZeroMQ's own heartbeats drop a dead link, so a restarted worker gets its name
        self.back.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_interval * 1000))
        self.back.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_interval * heartbeat_liveness * 1000))
        self.front_keyed = curve_secret is not None  # a client's tenant is the CURVE key it proved
        self.accepting_heartbeats = True  # False once handing off
        self.no_instance_timeout = no_instance_timeout
        self.hooks = hooks or BrokerHooks()
        expiry = heartbeat_interval * heartbeat_liveness
        self.tables = Tables(models, Ledger(tenants), residency, embedding_models, chat_templates or {})
        self.outbox = WorkerOutbox(self.back, self.tables, expiry)
        self.answers = Answers(self.tables, self.outbox, self.front, self.admin)
        self.dispatcher = Dispatcher(self.tables, self.answers, self.outbox, self.hooks)
        self.adapter_ops = AdapterOps(self.tables, self.dispatcher)  # LoRA adapters loaded and unloaded at run time
        self.adopter = Adopter(self.tables, self.dispatcher)
        self.clients = Clients(self.tables, self.dispatcher, self.adopter, self.adapter_ops, self.hooks,
                               max_queue_total=max_queue_total, max_pending_per_client=max_pending_per_client,
                               client_timeout=client_timeout)
        self.results = Results(self.tables, self.dispatcher)
        self.registry = Registry(self.tables, self.results, self.clients, self.hooks, pool_keys=pool_keys or {},
                                 expiry=expiry)

    # --- the event sources -------------------------------------------------------------------

    def drain_front(self) -> None:
        for _ in range(DRAIN_BATCH):
            if not zmqio.readable(self.front):
                break
            if self.front_keyed:  # the key each client proved is its tenant
                self.clients.message(*zmqio.recv_keyed(self.front, zmqio.NOBLOCK))
            else:
                self.clients.message(zmqio.recv(self.front, zmqio.NOBLOCK))
        self.flush()

    def drain_admin(self) -> None:
        assert self.admin is not None
        for _ in range(DRAIN_BATCH):
            if not zmqio.readable(self.admin):
                break
            frames = zmqio.recv(self.admin, zmqio.NOBLOCK)
            self.clients.message([roles.admin_client(frames[0]), *frames[1:]], "", admin=True)
        self.flush()

    def drain_back(self) -> None:
        for _ in range(DRAIN_BATCH):
            if not zmqio.readable(self.back):
                break
            if self.registry.pool_keys:  # which key each message came with: READY is checked against its models
                self.registry.message(*zmqio.recv_keyed(self.back, zmqio.NOBLOCK))
            else:
                self.registry.message(zmqio.recv(self.back, zmqio.NOBLOCK))
        self.flush()

    def flush(self) -> None:
        """Send the ASSIGNs gathered since the last flush: to each worker, one message; write what the journal
        gathered."""
        self.outbox.flush()
        if self.tables.journal.records:
            self.tables.journal.flush(lambda: itertools.chain(self.tables.requests.values(),
                                                              self.adopter.adoptions.held()))

    # --- deadlines and timers --------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        deadlines = self.tables.deadlines
        while deadlines and self.tables.stale_deadline(deadlines[0][1]):
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else None

    def expire(self, now: float) -> None:
        if self.adapter_ops.draining:  # unloads whose adapter's last requests may have ended
            self.adapter_ops.drain()
        self.clients.retry_contested(now)
        deadlines = self.tables.deadlines
        while deadlines and deadlines[0][0] <= now:
            _, ticket = heapq.heappop(deadlines)
            if self.tables.stale_deadline(ticket):
                continue
            p = self.tables.requests[ticket]
            if p.worker is None and not self.tables.registered(p.model):
                self.answers.unserved(p, unserved.refusal(self.tables.models[p.model], self.hooks.loading(p.model),
                                                          now))
                continue
            self.tables.stats[ErrorCode.TIMEOUT] += 1
            self.answers.cancel(p, ErrorCode.TIMEOUT,
                                f"request did not finish within its timeout of {p.request.timeout} s")

    def expire_unserved(self, now: float) -> None:
        """End the queued requests of each model that no instance could serve for ``no_instance_timeout``
        (``mpserve.server.unserved``)."""
        for mq in list(self.tables.models.values()):
            if self.tables.registered(mq.name) or self.hooks.loading(mq.name):
                mq.unserved_since = None
                continue
            since = mq.unserved_since = mq.unserved_since or now
            ending = [t for t in mq.queue if unserved.due(self.tables.requests[t].accepted, since, now,
                                                          self.no_instance_timeout)]
            if ending:
                message = unserved.refusal(mq, False, now)
                log.warning("%d request(s) of %s waited %.0f s (no_instance_timeout) with no instance to serve "
                            "them; ending them: %s", len(ending), mq.name, self.no_instance_timeout, message)
            for ticket in ending:
                self.answers.unserved(self.tables.requests[ticket], message)

    def expire_clients(self, now: float) -> None:
        """Cancel the requests of clients that stopped sending (closed, killed, or partitioned)."""
        self.clients.expire(now)

    def expire_workers(self, now: float) -> None:
        """Declare lost the remote workers silent past the heartbeat expiry, or an ASSIGN could not reach."""
        self.registry.expire(now)

    def expire_adoptions(self, now: float) -> None:
        """Forget the adopted requests no client reattached to in time, and stop expecting adoptees past their
        wait (the reattached requests held for them run anew)."""
        self.adopter.expire(now)
        if self.clients.held and not self.adopter.adoptions.expecting(now):
            self.clients.release_held()

    def send_heartbeats(self) -> None:
        if not self.accepting_heartbeats:
            return
        for identity in list(self.tables.workers):
            self.outbox.to_worker(identity, wire.Heartbeat(identity.decode(), pid=os.getpid()))

    # --- what the supervisor tells ---------------------------------------------------------------

    def worker_stalled(self, index: int, silent_s: float) -> None:
        """The supervisor is about to kill a worker that stopped making progress (``Registry.worker_stalled``)."""
        self.registry.worker_stalled(index, silent_s)

    def worker_exited(self, index: int, code: int | None) -> None:
        """The supervisor reaped local worker ``index`` (``Registry.worker_exited``). One that exited cleanly said
        LEAVING, after its last CHUNKs, before it went; under load its exit can be seen before they are read, and its
        requests would be handed over without the tokens those carried. So while it is still registered, what the
        back socket gets is read first, for up to LAST_WORDS_S (at once, as a rule: they were sent before it exited)."""
        deadline = time.monotonic() + LAST_WORDS_S
        while code == 0 and self.tables.worker_at(index) is not None and (left := deadline - time.monotonic()) > 0:
            if self.back.poll(max(1, round(left * 1000))):
                self.drain_back()
        self.registry.worker_exited(index, code)

    def model_failed(self, model: str, message: str) -> None:
        """The supervisor gave up loading ``model`` (``message``: the load error)."""
        self.registry.model_failed(model, message)

    def keep_journal(self, path: Path, resume: bool) -> None:
        """Journal the live requests at ``path`` from now on; ``resume``: first take what the journal of the server
        before this one left there, held for their clients (``Adopter.journaled``)."""
        found = resume and path.exists()
        rows = journal.read(path) if found else []
        self.tables.journal = Journal(path)
        self.adopter.journaled(rows, found)

    def expect(self, indexes: list[int], secrets: tuple[str, ...], wait: float) -> None:
        """The instances at ``indexes`` outlived the server before this one (``Adopter.expect``)."""
        self.adopter.expect(indexes, secrets, wait)

    def adoptee_lost(self, index: int) -> None:
        """Adoptee ``index`` exited, or was killed for not registering in time: it brings nothing."""
        self.adopter.lost(index)
        if not self.adopter.adoptions.expected:
            self.clients.release_held()

    @property
    def link_secret(self) -> str:
        """The proof of the workers this start runs (``Supervisor``)."""
        return self.adopter.link_secret

    @property
    def secrets(self) -> tuple[str, ...]:
        """The proofs this server's local workers show: this start's, then the adopted instances'."""
        return self.adopter.secrets

    # --- the server's verbs ----------------------------------------------------------------------

    def drain(self, identity: bytes) -> None:
        """Scale down: the worker gets no new request; once it runs none it is told to STOP."""
        self.dispatcher.drain(identity)

    def hand_over(self, identity: bytes) -> bool:
        """A roll replaces the worker (``Dispatcher.hand_over``); whether it hands its requests over."""
        return self.dispatcher.hand_over(identity)

    def dispatch_all(self) -> None:
        """Every model's queue looked at again (a reload changed the tenants' limits)."""
        self.dispatcher.dispatch_all()

    def snapshot(self, nonce: int = 0, tenant: str = "") -> wire.Stats:
        """The figures STATS answers (``Clients.snapshot``)."""
        return self.clients.snapshot(nonce, tenant)

    def stop_accepting(self) -> None:
        self.tables.accepting = False

    def in_flight(self) -> int:
        return sum(1 for p in self.tables.requests.values() if not p.answered)

    def abort_all(self, code: str, message: str) -> None:
        for p in list(self.tables.requests.values()):
            if not p.answered:
                self.answers.cancel(p, code, message)

    def stop_workers(self) -> None:
        for identity in list(self.tables.workers):
            self.outbox.to_worker(identity, wire.Stop("server shutting down"))

    def hand_off(self) -> None:
        """An upgrade: every local instance is told to hold its requests for the next start (HAND_OFF); the broker
        sends no heartbeat from now on (one would tell an instance it was adopted). ``tables.handing``: those that
        have not answered yet (their READY)."""
        self.tables.handing = {w.identity for w in self.tables.workers.values() if w.index is not None}
        for identity in self.tables.handing:
            self.outbox.to_worker(identity, wire.HandOff("the server is upgrading"))
        self.accepting_heartbeats = False

    def close(self) -> None:
        self.tables.journal.close()
        self.front.close(linger=500)
        self.back.close(linger=500)
        if self.admin is not None:
            self.admin.close(linger=500)


def _router(ctx: zmq.Context[Any], addr: str, curve_secret: str | None, zap_domain: bytes) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
    if curve_secret is not None:
        public, secret = zmq.auth.load_certificate(curve_secret)
        sock.curve_publickey, sock.curve_secretkey, sock.curve_server = public, secret, True
        sock.zap_domain = zap_domain  # which allow-list the authenticator checks
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES + 4096)
    sock.setsockopt(zmq.SNDHWM, 10000)
    sock.setsockopt(zmq.RCVHWM, 10000)
    sock.bind(addr)
    return sock
