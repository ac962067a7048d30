"""The broker: one event loop that routes requests from clients to free worker slots.

    clients ──DEALER──▶ front ROUTER ─┐                  ┌─ back ROUTER ◀──DEALER── workers
                                      ▼                  ▲
    validate ─▶ per-model queue ───────▶ assign to a free slot of that model (the one whose last prompt
                                        shares the longest prefix, or whose instance's host store holds
                                        it, as its DONEs' CACHE frames said; else one of the least busy
                                        instance)
                                      ▲                  │
        CHUNK/DONE/ERROR bodies ◀─────┴── forwarded unchanged, looked up by ticket
    a queue by priority (``Request.priority``, higher first; equal ones in order of arrival); when requests still
    wait and no slot is free, running requests of lower priority are preempted (``mpserve.server.preemption``):
    PREEMPT, then the waiting request's ASSIGN into that slot ─▶ the worker parks one and admits the other ─▶
    PARKED: the preempted request queued again, resumed later on that worker by an ASSIGN under its ticket

        STEP (one worker step)    ──▶ in order; per client, the step's CHUNK bodies spliced into one CHUNKS
                                      (one: a CHUNK), sent before that client's next DONE or ERROR
        ASSIGNs of one turn       ──▶ per worker, gathered and sent as one ASSIGNS (``flush``, at the end
                                      of each drain and of each loop turn; before anything else sent to
                                      that worker)

    tenants ─▶ each request is its tenant's: on the clients' socket its connection's (a CURVE client's key; "" on
               ipc), on the admin socket the ``tenant`` the gateway names; counted, queued and limited per tenant
               (``mpserve.server.tenants``: priority, then weighted fair shares of slot time; max_running passes a
               tenant over, max_queued and tokens_per_minute refuse, ERROR ``busy`` naming the limit)

    n choices ─▶ n rows in ``requests``, one per choice (seeded seed, seed+1, …), queued as one: it starts once
                n slots of one instance are free, all n together (``routing.choose_slots``); each choice's
                CHUNKs and DONE carry its index; the first ERROR of any answers the request; a choice whose
                worker is lost is retried or handed over on its own, in one slot

    TOKENIZE ─▶ at once to the least busy loaded instance of the model (no slot, no queue); its TOKENS or
    EMBED       ERROR (EMBEDDINGS or ERROR) is forwarded the same way (``lookups``: ticket -> client, request id,
                worker), taken from that worker only. EMBED goes to embedding models only (``embedding: true``),
                REQUEST to the others
    SLOT_ACTION ─▶ at once to the instance it names; its SLOT_REPLY or ERROR, the same way
    admin ROUTER ─▶ the same handling, as an operator: CONTROL and SLOT_ACTION come only this way; on the front
                    they are refused, ERROR ``forbidden`` (``mpserve.server.roles``)

State lives in three tables (``mpserve.server.state``, which draws a request's states): ``requests``
(ticket -> Pending), ``workers`` (identity -> WorkerEntry) and ``models`` (name -> ModelQueue). Every
accepted request ends with exactly one terminal message to its client (DONE or ERROR); the ANSWERED
state records that it was sent, so a late worker reply for a request that already timed out or was
cancelled frees the worker without reaching the client twice. Routing and the retry rules are pure
functions in ``mpserve.server.routing``.

The worker socket trusts a peer once it registered (READY, by ``mpserve.server.link``'s rules), and for its own
requests only:

    peer not registered ──▶ READY: registered, or refused · FAILED proving a local worker: its supervisor counts
                            it · HEARTBEAT: asked to register · anything else: dropped, counted
                            (``dropped_unregistered``), logged
    registered worker ──▶ an answer counts under a ticket the broker gave that worker (tickets are random:
                          ``new_ticket``); under another's, or none live, it is dropped and counted
    any message whose handling raises ──▶ logged, counted (``worker_message_failed``), dropped; the broker serves on
    a remote pool's READY ──▶ refused for a model its key may not serve (``mpserve.server.pool_keys``)
    a READY's chat template ──▶ ``mpserve.server.chat``: a local instance's first is the model's; a remote pool's
                                that differs is refused, never handed out

Worker deaths and stalls arrive from the supervisor (process sentinels in the same poll; a death with the
worker's exit status), the loss of a remote worker from its silence or from an ASSIGN its link did not take
(``expire_workers``): a request that
had not streamed anything is retried on another instance; one that had is resumed there from the token ids
its CHUNKs carried (``Pending.generated``: the prompt, then those tokens, for the rest of ``max_tokens``),
so its client sees one stream. How the worker ended decides what the loss counts as (``routing``: crash
or hand-over):

    local worker ──exit status──▶ crash signal (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) ─▶ a crash of each
                                  request it ran, and of its model (``_model_crashed``)
                                  anything else (SIGKILL, SIGTERM, an exit code) ─▶ a hand-over
    stalled (watchdog) ─────────▶ a crash of each request it ran (not of its model)
    remote worker silent, or a new process under a lost one's name ─▶ a hand-over
    a worker's LEAVING (told to stop, terminated, its server or pool gone) ─▶ a hand-over, at once

A request that has now crashed two workers is failed with ``poison_request``; one that has been handed
over MAX_HANDOVERS times, with ``worker_lost`` naming that bound; neither is retried again. A model whose
workers crashed on MODEL_CRASHES different requests in a row is failed (``model_failed``, naming the signal
and the settings to try), its requests with it; the server's loop stops the supervisor restarting it.
(``worker_lost`` also remains for a worker that streamed without reporting its tokens.)

A queued request whose model has no instance registered or loading for ``no_instance_timeout`` ends
``no_instance`` saying why (``mpserve.server.unserved``): none ever registered, its pool gone, its last instance
lost; so does a stream whose last instance was lost, after its text, and a request whose ``timeout`` passes
while it waits for a model with no instance (still loading, or one of those).

The broker never blocks on a client: sends are non-blocking, and a client that cannot take a message
(gone, or not reading past its high-water mark) has its requests cancelled.

At debug level the broker logs each request as it is queued and each start on a worker, in the order it
handles them: the order of its decisions, which no client's clock can reconstruct.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import os
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable
from signal import Signals
from typing import Any

import msgspec
import zmq
import zmq.auth

from mpserve.config.tenants import Tenants
from mpserve.counts import counted
from mpserve.errors import (
    BadRequest,
    Busy,
    ErrorCode,
    Forbidden,
    ModelFailed,
    MpserveError,
    ProtocolError,
    ShuttingDown,
    UnknownModel,
)
from mpserve.wire import adapters as wire_adapters
from mpserve.wire import protocol as wire
from mpserve.wire import zmqio
from mpserve.wire.prefix import PREFIX_BLOCK, block_hashes
from mpserve.wire.protocol import ChatTemplate
from mpserve.wire.salt import reuse_salt

from . import adoption, chat, link, pool_keys, preemption, roles, unserved
from .adapter_ops import AdapterOps
from .pool_keys import PoolKey
from .residency import Loaded, Residency
from .routing import (
    MAX_HANDOVERS,
    MODEL_CRASHES,
    QUEUE_WINDOW,
    AfterLoss,
    after_loss,
    choose_slots,
    crash_signal,
    crash_streak,
    describe_exit,
    pick_queued,
)
from .state import Lost, ModelQueue, Pending, RequestState, WorkerEntry
from .tenants import FairQueue, Ledger, shown

log = logging.getLogger("mpserve.broker")

DEFAULT_SERVICE_MS = 250.0
MAX_RETRY_AFTER_S = 30.0
DRAIN_BATCH = 256
ASSIGN_BATCH = 64  # ASSIGNs gathered for one worker before they go without waiting for the turn's end
CHUNK_FRAME = wire.TYPE_FRAMES[wire.MsgType.CHUNK]
TRAILED = {CHUNK_FRAME, *(wire.TYPE_FRAMES[t] for t in (wire.MsgType.DONE, wire.MsgType.ERROR, wire.MsgType.READY,
                                                       wire.MsgType.PARKED))}  # may have a 5th frame
CHUNKS_FRAME = wire.TYPE_FRAMES[wire.MsgType.CHUNKS]
TICKET_BYTES = 16
LOOKUP_ANSWERS = {wire.MsgType.TOKENS, wire.MsgType.EMBEDDINGS, wire.MsgType.SLOT_REPLY, wire.MsgType.ERROR}
UNREGISTERED_LOG_S = 10.0  # messages from peers not registered are counted each, logged at most this often
FROM_CLIENTS = {wire.MsgType.REQUEST, wire.MsgType.CANCEL, wire.MsgType.PING, wire.MsgType.TOKENIZE,
                wire.MsgType.EMBED, wire.MsgType.STATS_QUERY, wire.MsgType.SLOT_ACTION, wire.MsgType.ADAPTER_ACTION,
                wire.MsgType.CONTROL}


class Broker:
    def __init__(self, ctx: zmq.Context[Any], front_addr: str, back_addr: str, models: dict[str, int], *,
                 max_queue_total: int = 4096, max_pending_per_client: int = 128, client_timeout: float = 5.0,
                 curve_secret: str | None = None, curve_workers: str | None = None,
                 residency: Residency | None = None, heartbeat_interval: float = 1.0,
                 heartbeat_liveness: int = 5, embedding_models: frozenset[str] = frozenset(),
                 admin_addr: str | None = None, curve_admins: str | None = None,
                 no_instance_timeout: float = unserved.DEFAULT_TIMEOUT_S,
                 chat_templates: dict[str, str] | None = None, pool_keys: dict[str, PoolKey] | None = None,
                 tenants: Tenants | None = None) -> None:
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
        ``tenants``: the ``tenants`` section (``mpserve.server.tenants``; None: one share, no limits)."""
        self.embedding_models = embedding_models
        self.chat_templates = chat_templates or {}
        self.pool_keys = pool_keys or {}
        self.front = _router(ctx, front_addr, curve_secret, b"clients")
        self.back = _router(ctx, back_addr, curve_secret if curve_workers else None, b"workers")
        self.admin = _router(ctx, admin_addr, curve_secret if curve_admins else None, b"admins") if admin_addr else None
        if admin_addr:
            roles.owner_only(admin_addr)
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_liveness = heartbeat_liveness
        # no ROUTER_HANDOVER: a connection under a connected worker's name gets none of its messages
        # (``mpserve.server.link``); ZeroMQ's own heartbeats drop a dead link, so a restarted worker gets its name
        self.back.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_interval * 1000))
        self.back.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_interval * heartbeat_liveness * 1000))
        self.link_secret = link.new_secret()  # the proof of the workers the server starts (``Supervisor``)
        self.start_id = secrets.token_hex(8)  # this start, in every PONG: a client that sees another one reattaches
        self.adopted_secrets: tuple[str, ...] = ()  # those of the instances it adopts (``adoption``)
        self.adoptions = adoption.Adoptions()
        self._held: list[tuple[bytes, wire.Request, str, bool]] = []  # reattached, waiting for the adoptees
        self.handing: set[bytes] = set()  # an upgrade: the instances told HAND_OFF that have not answered yet
        self.accepting_heartbeats = True  # False once handing off
        self.ledger = Ledger(tenants)
        self.front_keyed = curve_secret is not None  # a client's tenant is the CURVE key it proved
        self.models = {name: self.new_queue(name, max_queue) for name, max_queue in models.items()}
        self.requests: dict[str, Pending] = {}
        self.by_client: dict[tuple[bytes, str], str] = {}
        self.workers: dict[bytes, WorkerEntry] = {}
        self.lookups: dict[str, tuple[bytes, str, bytes]] = {}  # TOKENIZE ticket -> client, id, worker
        self.adapter_ops = AdapterOps(self)  # LoRA adapters loaded and unloaded at run time
        self.stats: Counter[str] = Counter()
        self.accepting = True
        self.residency = residency
        self.max_queue_total = max_queue_total
        self.max_pending_per_client = max_pending_per_client
        self.client_timeout = client_timeout
        self.no_instance_timeout = no_instance_timeout
        self._heard: dict[bytes, float] = {}  # clients with pending requests -> last message time
        self._owned: dict[bytes, int] = {}  # clients -> number of pending requests
        self._capped: dict[bytes, int] = {}  # pending requests per client, or per tenant the gateway named
        self._deadlines: list[tuple[float, str]] = []
        self._assigns: dict[bytes, list[bytes]] = {}  # worker -> packed ASSIGNs not sent yet (``flush``)
        self._undelivered: set[bytes] = set()  # remote workers an ASSIGN could not be sent to (``expire_workers``)
        self._unregistered_logged = -UNREGISTERED_LOG_S  # when a message from an unregistered peer was last logged
        self.on_ready: Callable[[WorkerEntry], None] = lambda entry: None  # set by the server: the
        self.on_failed: Callable[[int, str], None] = lambda index, message: None  # supervisor's view of loads
        self.on_drained: Callable[[WorkerEntry], None] = lambda entry: None  # a drained worker was told to STOP
        self.on_control: Callable[[wire.Control], wire.ControlReply] = _no_control
        self.removed: set[str] = set()  # models a reload removed: new requests refused, the rest finish
        self.scaling_of: Callable[[str], wire.ModelScaling] = lambda model: wire.ModelScaling()  # for STATS
        self.loading: Callable[[str], bool] = lambda model: False  # an instance of the model is starting

    def new_queue(self, name: str, max_queue: int) -> ModelQueue:
        """The queue of a model, its tenants weighted by their settings."""
        return ModelQueue(name, max_queue, FairQueue(self.ledger.weight))

    # --- the event sources -------------------------------------------------------------------

    def drain_front(self) -> None:
        for _ in range(DRAIN_BATCH):
            if not zmqio.readable(self.front):
                break
            if self.front_keyed:  # the key each client proved is its tenant
                self._from_client(*zmqio.recv_keyed(self.front, zmqio.NOBLOCK))
            else:
                self._from_client(zmqio.recv(self.front, zmqio.NOBLOCK))
        self.flush()

    def drain_admin(self) -> None:
        assert self.admin is not None
        for _ in range(DRAIN_BATCH):
            if not zmqio.readable(self.admin):
                break
            frames = zmqio.recv(self.admin, zmqio.NOBLOCK)
            self._from_client([roles.admin_client(frames[0]), *frames[1:]], "", admin=True)
        self.flush()

    def drain_back(self) -> None:
        for _ in range(DRAIN_BATCH):
            if not zmqio.readable(self.back):
                break
            if self.pool_keys:  # which key each message came with: READY is checked against its models
                self._from_worker(*zmqio.recv_keyed(self.back, zmqio.NOBLOCK))
            else:
                self._from_worker(zmqio.recv(self.back, zmqio.NOBLOCK))
        self.flush()

    def flush(self) -> None:
        """Send the ASSIGNs gathered since the last flush: to each worker, one message."""
        for identity in list(self._assigns):
            self._flush_assigns(identity)

    def next_deadline(self) -> float | None:
        while self._deadlines and self._stale_deadline(self._deadlines[0][1]):
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def expire(self, now: float) -> None:
        if self.adapter_ops.draining:  # unloads whose adapter's last requests may have ended
            self.adapter_ops.drain()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, ticket = heapq.heappop(self._deadlines)
            if self._stale_deadline(ticket):
                continue
            p = self.requests[ticket]
            if p.worker is None and not self._registered(p.model):
                self._unserved(p, unserved.refusal(self.models[p.model], self.loading(p.model), now))
                continue
            self.stats[ErrorCode.TIMEOUT] += 1
            self._cancel(p, ErrorCode.TIMEOUT, f"request did not finish within its timeout of {p.request.timeout} s")

    def expire_unserved(self, now: float) -> None:
        """End the queued requests of each model that no instance could serve for ``no_instance_timeout``
        (``mpserve.server.unserved``)."""
        for mq in list(self.models.values()):
            if self._registered(mq.name) or self.loading(mq.name):
                mq.unserved_since = None
                continue
            since = mq.unserved_since = mq.unserved_since or now
            ending = [t for t in mq.queue if unserved.due(self.requests[t].accepted, since, now,
                                                          self.no_instance_timeout)]
            if ending:
                message = unserved.refusal(mq, False, now)
                log.warning("%d request(s) of %s waited %.0f s (no_instance_timeout) with no instance to serve "
                            "them; ending them: %s", len(ending), mq.name, self.no_instance_timeout, message)
            for ticket in ending:
                self._unserved(self.requests[ticket], message)

    def _registered(self, model: str) -> bool:
        """Whether an instance of ``model`` that takes requests is registered."""
        return any(w.model == model and not w.draining for w in self.workers.values())

    def _unserved(self, p: Pending, message: str) -> None:
        """End queued ``p``, whose model no instance serves: ERROR ``no_instance`` with ``message``."""
        queue = self.models[p.model].queue
        if p.ticket in queue:  # not the other choices of a request for n: they wait with the first
            queue.remove(p.ticket)
        self.stats[ErrorCode.NO_INSTANCE] += 1
        self._answer_error(p, ErrorCode.NO_INSTANCE, message, retry_after=MAX_RETRY_AFTER_S)

    def expire_clients(self, now: float) -> None:
        """Cancel the requests of clients that stopped sending (closed, killed, or partitioned)."""
        silent = [c for c, heard in self._heard.items() if now - heard > self.client_timeout]
        for client in silent:
            del self._heard[client]
            self.stats["client_expired"] += 1
            log.warning("client %s sent nothing for %.0f s; cancelling its requests", client.hex(),
                        self.client_timeout)
            self._drop_client(client, f"cancelled: this client sent nothing for {self.client_timeout:g} s")

    def worker_stalled(self, index: int, silent_s: float) -> None:
        """The supervisor is about to kill a worker that stopped making progress: its requests go elsewhere
        now, by the rules of a worker that crashed (a request can hang an engine as it can crash one: one that
        stalls or crashes two workers is poison). A stall does not count toward its model's crashes: it names
        no signal, and a host short of CPU stalls healthy workers."""
        entry = next((w for w in self.workers.values() if w.index == index), None)
        if entry is not None:
            self._worker_gone(entry, f"worker {index} produced no token for {silent_s:.1f} s", crashed=True)
        self.flush()

    def worker_exited(self, index: int, code: int | None) -> None:
        """The supervisor reaped local worker ``index``, which ended with exit status ``code`` (negative: the
        signal that ended it). A crash signal (``routing.crash_signal``) is a crash of the requests it ran, and
        of its model (``_model_crashed``); any other end hands them over."""
        entry = next((w for w in self.workers.values() if w.index == index), None)
        if entry is not None:
            sig = crash_signal(code)
            if sig is not None:
                self._model_crashed(entry, sig)
            self._worker_gone(entry, f"worker {index} exited with {describe_exit(code)}", crashed=sig is not None)
        self.flush()

    def expire_workers(self, now: float) -> None:
        """Declare lost the remote workers silent for longer than the heartbeat expiry, and those an ASSIGN could
        not be sent to: its request never reached them, and one that talks again on a new link (it reconnected
        and registers again, as the same process) would otherwise hold it unanswered for good."""
        undelivered, self._undelivered = self._undelivered, set()  # a hand-over below may add to the next turn's
        for identity in undelivered:
            entry = self.workers.get(identity)
            if entry is not None and entry.index is None:
                self.stats["worker_link_down"] += 1
                log.warning("worker %s on %s: a request could not be sent to it; declared lost, its requests go "
                            "elsewhere", identity.decode(), entry.host)
                self._worker_gone(entry, f"the link to worker {identity.decode()} on {entry.host} went down",
                                  crashed=False)
        expiry = self.heartbeat_interval * self.heartbeat_liveness
        for entry in [w for w in self.workers.values() if w.index is None and now - w.last_heard > expiry]:
            self.stats["worker_expired"] += 1
            log.warning("worker %s on %s sent nothing for %.1f s; declared lost", entry.identity.decode(),
                        entry.host, now - entry.last_heard)
            self._worker_gone(entry, f"worker {entry.identity.decode()} on {entry.host} was lost", crashed=False)
        self.flush()

    def send_heartbeats(self) -> None:
        if not self.accepting_heartbeats:
            return
        for identity in list(self.workers):
            self._to_worker(identity, wire.Heartbeat(identity.decode(), pid=os.getpid()))

    def _worker_gone(self, entry: WorkerEntry, what: str, crashed: bool) -> None:
        """A worker died, stalled or was lost: settle its requests by the rules, each counting a crash if
        ``crashed``, else a hand-over."""
        self._forget_worker(entry)
        if self.models[entry.model].instances == 0:
            self.models[entry.model].lost = Lost(what, time.monotonic(), remote=entry.index is None)
        self._lookups_lost(entry.identity, what)
        self.adapter_ops.lost(entry.identity)
        lost = [self.requests[t] for t in entry.running if t in self.requests]
        for p in sorted(lost, key=lambda p: (p.accepted, p.index)):
            self._after_loss(p, what, crashed)
        self._dispatch(entry.model)

    def _model_crashed(self, entry: WorkerEntry, sig: Signals) -> None:
        """A worker of the model died of ``sig`` running its requests: the model's crash streak grows
        (``routing.crash_streak``); at MODEL_CRASHES the model is failed, before the requests are settled, so
        that they too end ``model_failed`` (the model's verdict wins over a request's poison)."""
        mq = self.models[entry.model]
        self.stats["worker_crashed"] += 1
        tickets = [t for t in entry.running if t in self.requests and not self.requests[t].answered]
        mq.crash_streak = crash_streak(mq, tickets)
        mq.crashed.update(tickets)
        if mq.crash_streak >= MODEL_CRASHES and mq.failed is None:
            log.error("model %s: its workers crashed with %s on %d different requests in a row; failing the model",
                      mq.name, sig.name, mq.crash_streak)
            self._fail_model(mq, crash_verdict(sig))

    def _after_loss(self, p: Pending, what: str, crashed: bool) -> None:
        """Settle one request of a worker that died or stalled: requeue it first in line (from its streamed
        tokens, if any), or fail it; a request of a failed model ends ``model_failed``."""
        self._left_slot(p)
        if p.answered:
            self._finish(p)
            return
        if crashed:
            p.crashes += 1
        else:
            p.handovers += 1
        mq = self.models[p.model]
        outcome = after_loss(p)
        if mq.failed is not None:
            self._answer_error(p, ErrorCode.MODEL_FAILED, mq.refusal())
        elif outcome is AfterLoss.POISON:
            self.stats[ErrorCode.POISON_REQUEST] += 1
            self._answer_error(p, ErrorCode.POISON_REQUEST, f"this request was running on {p.crashes} workers "
                               "that crashed or stalled; it will not be retried")
        elif outcome is AfterLoss.BOUND:
            self.stats[ErrorCode.WORKER_LOST] += 1
            self._answer_error(p, ErrorCode.WORKER_LOST, f"{what}; this request has lost {p.handovers} workers "
                               f"that were killed or went away, the bound on hand-overs ({MAX_HANDOVERS}), "
                               "and is not handed over again; retry the request")
        elif outcome is AfterLoss.LOST:
            self.stats[ErrorCode.WORKER_LOST] += 1
            self._answer_error(p, ErrorCode.WORKER_LOST, f"{what} after it had streamed text; retry the request")
        else:
            resumed = bool(p.generated)
            self.stats["resumed" if resumed else "retried"] += 1
            log.info("%s request %s: %s", f"resuming after {len(p.generated) // 4} tokens" if resumed
                     else "retrying", p.request.id, what)
            p.state = RequestState.QUEUED
            mq.queue.requeue(p.ticket, p.tenant, p.priority, p.cost)

    def model_failed(self, model: str, message: str) -> None:
        """The supervisor gave up loading ``model`` (``message``: the load error)."""
        self._fail_model(self.models[model], f"cannot be loaded: {message}")

    def _fail_model(self, mq: ModelQueue, reason: str) -> None:
        """The model serves nothing more: its queued requests, and those of its workers that die from now on,
        end ``model_failed``, and new ones are refused; ``reason`` follows "model NAME " in the message."""
        mq.failed = reason
        for ticket in mq.queue:
            mq.queue.remove(ticket)
            self._answer_error(self.requests[ticket], ErrorCode.MODEL_FAILED, mq.refusal())

    def drain(self, identity: bytes) -> None:
        """Scale down: the worker gets no new request; once it runs none it is told to STOP (``on_drained``)."""
        entry = self.workers[identity]
        entry.draining = True
        mq = self.models[entry.model]
        mq.free = deque(f for f in mq.free if f[0] != identity)
        self._stop_if_drained(entry)
        self._dispatch(entry.model)
        self.flush()

    def hand_over(self, identity: bytes) -> bool:
        """A roll replaces the worker (``mpserve.server.rolling``): where each request it runs can go on elsewhere
        from the tokens it streamed (as after a worker's loss: ``routing.after_loss``), it is told to STOP now, and
        its LEAVING hands them over, first in line; else it drains as a scaled-down one does. Whether it hands
        them over."""
        entry = self.workers[identity]
        running = [self.requests[t] for t in entry.running if t in self.requests]
        if any(p.handovers + 1 >= MAX_HANDOVERS or (p.state is RequestState.STREAMING and not
                                                    (p.generated and p.tokens_known)) for p in running):
            self.drain(identity)
            return False
        entry.draining = True
        mq = self.models[entry.model]
        mq.free = deque(f for f in mq.free if f[0] != identity)
        self._to_worker(identity, wire.Stop("replaced by a roll"))
        self.on_drained(entry)
        self.flush()
        return True

    def _stop_if_drained(self, entry: WorkerEntry) -> None:
        if entry.draining and not entry.running:
            self._to_worker(entry.identity, wire.Stop("scaled down"))
            self.on_drained(entry)

    def stop_accepting(self) -> None:
        self.accepting = False

    def in_flight(self) -> int:
        return sum(1 for p in self.requests.values() if not p.answered)

    def abort_all(self, code: str, message: str) -> None:
        for p in list(self.requests.values()):
            if not p.answered:
                self._cancel(p, code, message)

    def stop_workers(self) -> None:
        for identity in list(self.workers):
            self._to_worker(identity, wire.Stop("server shutting down"))

    def hand_off(self) -> None:
        """An upgrade: every local instance is told to hold its requests for the next start (HAND_OFF); the broker
        sends no heartbeat from now on (one would tell an instance it was adopted). ``handing``: those that have not
        answered yet (their READY)."""
        self.handing = {w.identity for w in self.workers.values() if w.index is not None}
        for identity in self.handing:
            self._to_worker(identity, wire.HandOff("the server is upgrading"))
        self.accepting_heartbeats = False

    def close(self) -> None:
        self.front.close(linger=500)
        self.back.close(linger=500)
        if self.admin is not None:
            self.admin.close(linger=500)

    # --- clients -------------------------------------------------------------------------------

    def _from_client(self, frames: list[bytes], tenant: str = "", admin: bool = False) -> None:
        """One message from a client; ``tenant``: its connection's (the CURVE key it proved), on the front."""
        if len(frames) < 2:
            self.stats["dropped_malformed"] += 1
            return
        client, frames = frames[0], frames[1:]
        if client in self._heard:
            self._heard[client] = time.monotonic()
        try:
            mtype = wire.parse_header(frames, 3)
            if mtype not in FROM_CLIENTS:
                raise ProtocolError(f"a client may not send {mtype.name} messages")
            roles.check(mtype, admin)
            msg = wire.decode_body(mtype, frames[2])
            if isinstance(msg, wire.Request):
                self._on_request(client, msg, self._tenant(msg, tenant, admin), admin)
            elif isinstance(msg, wire.Cancel):
                self._on_cancel(client, msg)
            elif isinstance(msg, wire.Ping):
                pong = wire.Pong(msg.nonce, tuple(self.models), wire.MAX_MESSAGE_BYTES,  # the limit: clients check
                                 self.start_id)
                self._to_client(client, wire.encode(pong))
            elif isinstance(msg, wire.Tokenize):
                self._on_tokenize(client, msg)
            elif isinstance(msg, wire.Embed):
                self._on_embed(client, msg)
            elif isinstance(msg, wire.StatsQuery):  # a keyed client reads its own tenant's figures, not others'
                self._to_client(client, wire.encode(self.snapshot(msg.nonce, "" if admin else tenant)))
            elif isinstance(msg, wire.SlotAction):
                self._on_slot_action(client, msg)
            elif isinstance(msg, wire.AdapterAction):
                self.adapter_ops.start(client, msg)
            else:  # CONTROL, the last of FROM_CLIENTS
                self._to_client(client, wire.encode(self.on_control(msg)))
        except MpserveError as exc:
            self.stats[f"rejected_{exc.code}"] += 1
            rid = wire.peek_id(frames[2]) if len(frames) == 3 else None
            self._to_client(client, wire.encode(wire.Error(rid, exc.code, exc.message, exc.retry_after)))
        except Exception:  # a bug: log it loudly, answer, and keep serving everyone else
            log.exception("internal error while handling a client message")
            self.stats["internal_error"] += 1
            rid = wire.peek_id(frames[2]) if len(frames) == 3 else None
            self._to_client(client, wire.encode(wire.Error(rid, ErrorCode.INTERNAL,
                                                           "internal error; see the server log")))

    def _tenant(self, req: wire.Request, connection: str, admin: bool) -> str:
        """Whose ``req`` is: on the admin socket, the tenant it names (the gateway's caller); on the clients'
        socket, its connection's (a ``tenant`` naming another is refused)."""
        if admin:
            return req.tenant
        if req.tenant in ("", connection):
            return connection
        raise Forbidden(f"'tenant' is named only over the server's admin socket (the gateway's); on this socket a "
                        f"request is its connection's, {shown(connection)}: leave 'tenant' out")

    def _on_request(self, client: bytes, req: wire.Request, tenant: str = "", admin: bool = False) -> None:
        if not self.accepting:
            raise ShuttingDown("the server is shutting down; retry after it restarts", retry_after=1.0)
        if (client, req.id) in self.by_client:
            if req.reattach:  # it reached this start already (sent as the client reconnected): it runs here
                return
            raise BadRequest(f"request id {req.id!r} is already in use by one of your pending requests")
        if req.reattach:
            if self._reattach(client, req, tenant):
                return
            if self.adoptions.expecting(time.monotonic()):  # its instance may not have registered yet
                self._held.append((client, req, tenant, admin))
                return
        model = self._resolve_model(req.model)
        mq = self.models[model]
        if req.adapters:  # one set, however written: sorted, each served (``mpserve.wire.adapters``)
            unserved = wire_adapters.unknown(req.adapters, mq.adapters, model)
            if unserved is not None:
                raise unserved
            req = msgspec.structs.replace(req, adapters=wire_adapters.normal(req.adapters))
        if model in self.embedding_models:
            raise BadRequest(f"model {model} is an embedding model (embedding: true in its models[] entry): it "
                             "computes embeddings (/v1/embeddings, Client.embed), not completions")
        if mq.failed is not None:
            raise ModelFailed(mq.refusal())
        if len(mq.queue) >= mq.max_queue and not mq.free:
            raise Busy(f"the queue of model {model} is full ({mq.max_queue} waiting); try again later",
                       retry_after=self._retry_after(mq))
        if self.queued() >= self.max_queue_total:
            raise Busy(f"the server has {counted(self.max_queue_total, 'request')} waiting; try again later",
                       retry_after=self._retry_after(mq))
        capped = _cap_key(client, tenant)
        if self._capped.get(capped, 0) >= self.max_pending_per_client:
            whose = f"tenant {shown(tenant)} has" if capped != client else "you have"
            raise Busy(f"{whose} {counted(self.max_pending_per_client, 'request')} pending, the most one client may "
                       "have (max_pending_per_client); wait for some to finish", retry_after=self._retry_after(mq))
        n = req.params.n
        refusal = self._too_many_choices(mq, n) if n > 1 else None  # one choice fits any instance
        if refusal is not None:
            raise BadRequest(refusal)
        now = time.monotonic()
        if self.ledger.limited(tenant):
            would_wait = bool(mq.queue) or len(mq.free) < n or not self.ledger.may_start(tenant, n)
            self.ledger.admit(tenant, sum(q.queue.waiting(tenant) for q in self.models.values()), would_wait, now)
        priority = self.ledger.priority(tenant, req.priority)
        if req.tenant != tenant or req.priority != priority:  # what the worker and routing see is what holds
            req = msgspec.structs.replace(req, tenant=tenant, priority=priority)
        cost = (mq.service_ms or DEFAULT_SERVICE_MS) / 1000
        self._heard.setdefault(client, now)
        tickets = tuple(new_ticket() for _ in range(n))
        for i, ticket in enumerate(tickets):  # a request for n: one row per choice, with its own parameters
            one = req if n == 1 else msgspec.structs.replace(req, params=req.params.choice_params(i))
            p = Pending(ticket, client, one, model, now, now + req.timeout if req.timeout else None,
                        group=tickets if n > 1 else (), index=i, tenant=tenant, priority=priority, cost=cost)
            self.requests[ticket] = p
            if p.deadline is not None:
                heapq.heappush(self._deadlines, (p.deadline, ticket))
        self.requests[tickets[0]].slots_needed = n
        self.by_client[(client, req.id)] = tickets[0]
        self._owned[client] = self._owned.get(client, 0) + n
        self._capped[capped] = self._capped.get(capped, 0) + n
        self.stats["accepted"] += 1
        self.ledger.accepted(tenant)
        mq.queue.append(tickets[0], tenant, priority, cost * n)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s of %s (tenant %s, priority %d): queued, %d waiting", req.id, model, shown(tenant),
                      priority, len(mq.queue))
        self._dispatch(model)

    def _too_many_choices(self, mq: ModelQueue, n: int) -> str | None:
        """Why ``n`` choices cannot run: no instance of the model (registered so far) has ``n`` slots."""
        most = max((w.capacity for w in self.workers.values() if w.model == mq.name), default=n)
        if n <= most:
            return None
        return (f"'n' = {n} is more than the {counted(most, 'slot')} of an instance of model {mq.name}: the choices "
                f"of a request run together in one instance; serve the model with 'parallel: {n}' (or --parallel {n}) "
                "or ask for fewer")

    def _on_tokenize(self, client: bytes, msg: wire.Tokenize | wire.Embed) -> None:
        """To the least busy instance of the model that has it loaded: the worker answers between steps."""
        if not self.accepting:
            raise ShuttingDown("the server is shutting down; retry after it restarts", retry_after=1.0)
        model = self._resolve_model(msg.model)
        loaded = [w for w in self.workers.values() if w.model == model and w.loaded and not w.unloading]
        if not loaded:
            raise Busy(f"no instance of model {model} has it loaded now; retry once one has", retry_after=1.0)
        worker = min(loaded, key=lambda w: len(w.running))
        ticket = new_ticket()
        self.lookups[ticket] = (client, msg.id, worker.identity)
        self.stats["tokenize" if isinstance(msg, wire.Tokenize) else "embed"] += 1
        self._to_worker(worker.identity, msgspec.structs.replace(msg, ticket=ticket))

    def _on_embed(self, client: bytes, msg: wire.Embed) -> None:
        """As TOKENIZE, for embedding models only."""
        model = self._resolve_model(msg.model)
        if model not in self.embedding_models:
            raise BadRequest(f"model {model} is not an embedding model: serve one with embedding: true in its "
                             "models[] entry to ask it for embeddings")
        self._on_tokenize(client, msg)

    def _on_slot_action(self, client: bytes, msg: wire.SlotAction) -> None:
        """To the instance it names: the worker acts on an idle slot between steps."""
        worker = self.workers.get(msg.worker.encode())
        if worker is None or not worker.loaded:
            raise BadRequest(f"no loaded instance {msg.worker!r}; `mpserve status` lists the instances and slots")
        ticket = new_ticket()
        self.lookups[ticket] = (client, msg.id, worker.identity)
        self.stats[f"slot_{msg.action}"] += 1
        self._to_worker(worker.identity, msgspec.structs.replace(msg, ticket=ticket))

    def _lookups_lost(self, identity: bytes, what: str) -> None:
        for ticket, (client, rid, worker) in list(self.lookups.items()):
            if worker == identity:
                del self.lookups[ticket]
                self._to_client(client, wire.encode(wire.Error(rid, ErrorCode.WORKER_LOST, f"{what}; retry")))

    def snapshot(self, nonce: int = 0, tenant: str = "") -> wire.Stats:
        """The figures STATS answers; with ``tenant`` (a keyed client's), that tenant's alone of the tenants'."""
        running: Counter[str] = Counter(w.model for w in self.workers.values() for _ in w.running)
        now, swaps = time.monotonic(), {"single_active_swaps": self.residency.swaps} if self.residency else {}
        return wire.Stats(nonce, self.accepting, {**self.stats, **swaps}, {
            name: wire.ModelStats(len(mq.queue), running[name], mq.instances, len(mq.free), mq.failed,
                                  mq.chat.template, mq.chat.bos_token, mq.chat.eos_token,
                                  round(now - self.requests[mq.queue.oldest()].accepted, 3) if mq.queue else 0.0,
                                  self.scaling_of(name), list(mq.adapters), mq.preempted,
                                  list(mq.adapters.values()))
            for name, mq in self.models.items()
        }, [wire.WorkerStats(w.identity.decode(), w.model, w.host, w.pid, w.device, w.capacity, len(w.running))
            for w in self.workers.values()],
            self.ledger.own_figures(tenant, self._waiting) if tenant else self.ledger.figures(self._waiting))

    def _waiting(self, tenant: str) -> int:
        """``tenant``'s requests queued now, over every model."""
        return sum(mq.queue.waiting(tenant) for mq in self.models.values())

    def queued(self) -> int:
        return sum(len(mq.queue) for mq in self.models.values())

    def _resolve_model(self, name: str | None) -> str:
        served = [m for m in self.models if m not in self.removed]
        if name is None:
            if len(served) == 1:
                return served[0]
            raise BadRequest(f"this server serves several models ({', '.join(served)}); name one")
        if name in self.removed:
            raise UnknownModel(f"model {name!r} was removed from the configuration (mpserve reload); served models: "
                               f"{', '.join(served)}")
        if name not in self.models:
            raise UnknownModel(f"model {name!r} is not served here; served models: {', '.join(served)}")
        return name

    def _retry_after(self, mq: ModelQueue) -> float:
        """About when a place in the queue frees: one request's service time for each slot's worth of
        requests ahead, within 0.1..30 s."""
        per_request = (mq.service_ms or DEFAULT_SERVICE_MS) / 1000.0
        slots = max(1, mq.instances * max((w.capacity for w in self.workers.values() if w.model == mq.name),
                                          default=1))
        return round(min(MAX_RETRY_AFTER_S, max(0.1, per_request * len(mq.queue) / slots)), 2)

    def _on_cancel(self, client: bytes, msg: wire.Cancel) -> None:
        ticket = self.by_client.get((client, msg.id))
        if ticket is not None and not self.requests[ticket].answered:
            self.stats[ErrorCode.CANCELLED] += 1
            self._cancel(self.requests[ticket], ErrorCode.CANCELLED, "cancelled by the client")

    def _cancel(self, p: Pending, code: str, message: str) -> None:
        """End a request now with ERROR ``code``; a running one is also stopped on its worker."""
        if p.worker is None:
            queue = self.models[p.model].queue
            if p.ticket in queue:
                queue.remove(p.ticket)
            self._answer_error(p, code, message)
        else:
            self._answer_error(p, code, message)  # the worker's late reply only frees the worker
            self._to_worker(p.worker, wire.Cancel(p.ticket))

    def _answer_error(self, p: Pending, code: str, message: str, retry_after: float | None = None) -> None:
        if not p.answered:
            p.state = RequestState.ANSWERED
            self._to_client(p.client, wire.encode(wire.Error(p.request.id, code, message, retry_after)))
            self._end_other_choices(p, code, message)
        if p.worker is None:
            self._finish(p)

    def _end_other_choices(self, p: Pending, code: str, message: str) -> None:
        """``p`` was answered with an error: the other choices of its request end with it, unanswered."""
        for other in self._choices(p):
            if other is not p and not other.answered:
                other.state = RequestState.ANSWERED
                self._cancel(other, code, message)

    def _choices(self, p: Pending) -> list[Pending]:
        """The rows still here of the request ``p`` is a choice of (``p`` alone for a request for one)."""
        return [self.requests[t] for t in p.group if t in self.requests] if p.group else [p]

    def _finish(self, p: Pending) -> None:
        self.requests.pop(p.ticket, None)
        self._unpark(p)
        key = (p.client, p.request.id)
        left = self._choices(p) if p.group else []
        if left:  # a request for n: its id stays in use until its last choice is done
            self.by_client[key] = left[0].ticket
        else:
            self.by_client.pop(key, None)
        capped = _cap_key(p.client, p.tenant)
        left_capped = self._capped.get(capped, 0) - 1
        if left_capped > 0:
            self._capped[capped] = left_capped
        else:
            self._capped.pop(capped, None)
        owned = self._owned.get(p.client, 0) - 1
        if owned > 0:
            self._owned[p.client] = owned
        else:
            self._owned.pop(p.client, None)
            self._heard.pop(p.client, None)

    def _to_client(self, client: bytes, frames: list[bytes]) -> bool:
        """Send without blocking. A client that is gone or not reading loses its requests."""
        try:
            if roles.is_admin(client):
                assert self.admin is not None
                zmqio.send(self.admin, [roles.routing_id(client), *frames], zmqio.NOBLOCK)
            else:
                zmqio.send(self.front, [client, *frames], zmqio.NOBLOCK)
            return True
        except (zmq.Again, zmq.ZMQError) as exc:
            reason = "not reading" if isinstance(exc, zmq.Again) else "gone"
            self.stats[f"client_{reason.replace(' ', '_')}"] += 1
            log.warning("client %s is %s; cancelling its requests", client.hex(), reason)
            self._drop_client(client)
            return False

    def _drop_client(self, client: bytes, why: str = "") -> None:
        """Stop everything a client asked for. A client that only went silent gets an ERROR ``why`` per request,
        which ends them if it comes back; to one that is gone or not reading (no ``why``) nothing more is sent."""
        for (owner, _), ticket in list(self.by_client.items()):
            p = self.requests.get(ticket)
            if owner == client and p is not None and not p.answered:
                self.stats["cancelled_client_gone"] += 1
                if why:  # its other choices end with it
                    self._cancel(p, ErrorCode.CANCELLED, why)
                for choice in [c for c in self._choices(p) if not c.answered]:
                    choice.state = RequestState.ANSWERED  # nothing more can reach it
                    self._cancel(choice, ErrorCode.CANCELLED, "client gone")

    # --- workers -------------------------------------------------------------------------------

    def _from_worker(self, frames: list[bytes], key: str = "") -> None:
        """One message on the worker socket (``key``: the CURVE key its peer proved, when the keys' models are
        limited). One that raises is logged, counted and dropped: the broker serves on (a bug, or a message no
        check foresaw, costs that message, not the server)."""
        try:
            self._worker_message(frames, key)
        except Exception:
            self.stats["worker_message_failed"] += 1
            log.exception("internal error while handling a message from worker %r; dropped it", frames[0])

    def _worker_message(self, frames: list[bytes], key: str) -> None:
        if len(frames) < 2:
            self.stats["dropped_worker_malformed"] += 1
            return
        identity, frames = frames[0], frames[1:]
        entry = self.workers.get(identity)
        if entry is not None:
            entry.last_heard = time.monotonic()
            entry.unreachable = False
        try:  # a fifth frame: a CHUNK's tokens, a DONE's or ERROR's host store changes, a READY's whole store
            mtype = wire.parse_header(frames, 5 if len(frames) == 5 and frames[1] in TRAILED else 4)
        except MpserveError as exc:
            self.stats["dropped_worker_malformed"] += 1
            log.warning("refused a message from worker %r: %s", identity, exc)
            self._to_worker(identity, wire.Error(None, exc.code, f"refused by the broker: {exc.message}"))
            return
        if entry is None and mtype is not wire.MsgType.READY:
            self._from_unregistered(identity, mtype, frames[3])
            return
        if frames[2] and self._lookup_answered(identity, mtype, frames[2].decode(errors="replace"), frames[3]):
            return
        if frames[2] and self.adapter_ops.answered(identity, mtype, frames[2].decode(errors="replace"), frames[3]):
            return
        if mtype is wire.MsgType.STEP:
            self._worker_step(identity, frames[3])
            return
        if mtype in wire.STEPPED:
            self._worker_result(identity, mtype, frames[2].decode(errors="replace"), frames[1], frames[3],
                                frames[4] if len(frames) == 5 else None)
            return
        if mtype in LOOKUP_ANSWERS:  # for a lookup no longer here (its client went, its worker was lost)
            self.stats["dropped_stale_result"] += 1
            return
        try:
            msg = wire.decode_body(mtype, frames[3])
        except MpserveError as exc:
            self.stats["dropped_worker_malformed"] += 1
            log.error("dropped a bad %s from worker %r: %s", mtype.name, identity, exc)
            return
        if isinstance(msg, wire.Ready):
            self._on_ready(identity, msg, frames[4] if len(frames) == 5 else None, key)
            return
        assert entry is not None
        if isinstance(msg, wire.Failed):
            self._load_failed(entry, msg.message)
        elif isinstance(msg, wire.Leaving):
            self._worker_left(entry, msg.reason)
        elif isinstance(msg, wire.Unloaded):
            entry.loaded = entry.unloading = False
            entry.prompts.clear()  # its KV cells went with the model; the host store keeps its entries
            self._unpin(entry)
            self._dispatch(entry.model)

    def _from_unregistered(self, identity: bytes, mtype: wire.MsgType, body: bytes) -> None:
        """A message from a peer that is not a registered worker: nothing of it is acted on, but a FAILED that
        proves it comes from one of the server's own workers (which fail to load before they register). A
        HEARTBEAT or UNLOADED is a worker that was lost, or registered with the broker before this one: it is
        asked to register; anything else is dropped, counted (``dropped_unregistered``) and logged."""
        if mtype is wire.MsgType.FAILED and self._local_load_failed(identity, body):
            return
        if mtype in (wire.MsgType.HEARTBEAT, wire.MsgType.UNLOADED):
            self._to_worker(identity, wire.Heartbeat(identity.decode(errors="replace"), registered=False))
            return
        if mtype is wire.MsgType.LEAVING:  # a worker this broker had already forgotten
            return
        self.stats["dropped_unregistered"] += 1
        now = time.monotonic()
        if now - self._unregistered_logged >= UNREGISTERED_LOG_S:
            self._unregistered_logged = now
            log.warning("dropped a %s from %r, which is not a registered worker (%d such messages so far; said at "
                        "most every %.0f s)", mtype.name, identity, self.stats["dropped_unregistered"],
                        UNREGISTERED_LOG_S)

    def _local_load_failed(self, identity: bytes, body: bytes) -> bool:
        """Whether ``body`` is the FAILED of one of the server's own workers (``link.local_index``): its supervisor
        is told."""
        try:
            failed = wire.decode_body(wire.MsgType.FAILED, body)
        except MpserveError:
            return False
        assert isinstance(failed, wire.Failed)
        index = link.local_index(identity, failed, self.secrets_of(identity))
        if index is not None:
            self.on_failed(index, failed.message)
        return index is not None

    def _lookup_answered(self, identity: bytes, mtype: wire.MsgType, ticket: str, body: bytes) -> bool:
        """Whether the message answered a lookup (TOKENIZE, EMBED, SLOT_ACTION): its answer (TOKENS, EMBEDDINGS,
        SLOT_REPLY or ERROR) goes to its client, taken only from the worker the lookup was sent to; an answer of
        another type, or from another worker, under a lookup's ticket is dropped and counted, and the lookup
        still waits for its worker."""
        lookup = self.lookups.get(ticket)
        if lookup is None:
            return False
        client, _, worker = lookup
        if worker != identity or mtype not in LOOKUP_ANSWERS:
            self.stats["dropped_foreign_lookup_answer"] += 1
            log.error("dropped a %s from worker %r under the ticket of a lookup sent to %r", mtype.name, identity,
                      worker)
            return True
        del self.lookups[ticket]
        self._to_client(client, [wire.VERSION, wire.TYPE_FRAMES[mtype], body])
        return True

    def _load_failed(self, entry: WorkerEntry, message: str) -> None:
        """A registered worker could not load its model (on demand): a local one's supervisor counts it; a remote
        one's pool does (it is said in the log)."""
        if entry.index is not None:
            self.on_failed(entry.index, message)
        else:
            log.error("worker %r on %s could not load %s: %s", entry.identity, entry.host, entry.model, message)

    def _on_ready(self, identity: bytes, msg: wire.Ready, cache: bytes | None, key: str = "") -> None:
        """A worker registered (again): ``cache`` is its whole host store's CACHE frame, if it holds any; ``key``
        the CURVE key it connected with (``pool_keys``: which models it may serve)."""
        if msg.protocol not in (wire.WORKER_LINK, wire.PREVIOUS_LINK):
            log.error("worker %r on %s speaks the worker protocol %r, this broker %r; refused (run the same mpserve "
                      "version on the pool's host)", identity, msg.host or "this host", msg.protocol, wire.WORKER_LINK)
            self._to_worker(identity, wire.Error(None, ErrorCode.PROTOCOL, (
                f"this broker speaks the worker protocol {wire.WORKER_LINK}, not {msg.protocol}: install the "
                "server's mpserve version on this host")))
            return
        if msg.model not in self.models:
            log.error("worker %r registered for model %r, which this broker does not serve (%s); ignored",
                      identity, msg.model, ", ".join(self.models))
            self._to_worker(identity, wire.Error(None, ErrorCode.UNKNOWN_MODEL,
                                                 f"this broker does not serve {msg.model!r}"))
            return
        old = self.workers.get(identity)
        if old is not None and old.pid == msg.pid and old.model == msg.model:
            # the same process registering again: it had not heard from us, or it loaded its model on demand,
            # which the supervisor counts as a good load (its model's failed loads start afresh), or it answers
            # a HAND_OFF
            self.handing.discard(identity)
            self._take_chat(identity, msg, old.index is not None)
            self._cache_held(old, cache)
            if msg.loaded and old.index is not None:
                old.loaded = True
                self.on_ready(old)
            return
        index = link.local_index(identity, msg, self.secrets_of(identity))
        refused = (link.refusal(identity, msg, index, old)
                   or (pool_keys.refusal(self.pool_keys.get(key), msg.model) if index is None else None)
                   or self._chat_refusal(msg, index is not None))
        if refused is not None:
            self.stats["refused_worker_ready"] += 1
            log.error("refused a READY from %r (pid %d, host %r): %s", identity, msg.pid, msg.host, refused)
            self._to_worker(identity, wire.Error(None, ErrorCode.PROTOCOL, f"refused by the broker: {refused}"))
            return
        if index is None and not self._answered(identity, msg):
            return
        if old is not None:  # a new process under the same name: whatever the old one ran is lost
            self._worker_gone(old, f"worker {identity.decode()} restarted", crashed=False)
        local = index is not None
        self._take_chat(identity, msg, local)
        entry = WorkerEntry(identity, index, msg.model, msg.device, msg.capacity,
                            msg.pid, msg.loaded, host=msg.host, last_heard=time.monotonic(),
                            ram=self.models[msg.model].store(msg.host), adapters=frozenset(msg.adapters),
                            code=f"{msg.version} {msg.protocol}", engine=msg.engine)
        self.workers[identity] = entry
        self._cache_held(entry, cache)
        mq = self.models[msg.model]
        mq.instances += 1
        mq.free.extend((identity, slot) for slot in range(msg.capacity))
        if local and identity in self.adoptions.expected:
            self._adopt(entry, msg.live)
        if local:
            self.on_ready(entry)
        else:
            log.info("worker %s on %s registered for %s", identity.decode(), msg.host, msg.model)
        self.adapter_ops.registered(entry)
        self._dispatch(msg.model)

    # --- adoption: the instances and requests of the server that died before this one ----------------

    @property
    def secrets(self) -> tuple[str, ...]:
        """The proofs this server's local workers show: this start's, then the adopted instances' (``adoption``)."""
        return (self.link_secret, *self.adopted_secrets)

    def secrets_of(self, identity: bytes) -> tuple[str, ...]:
        """The proofs local worker ``identity`` may show: an adoptee's (expected, or adopted) may be the secret of
        the server before this one; any other's is this start's (an instance of that server it did not adopt, whose
        index a new instance took, is refused)."""
        return self.secrets if identity in self.adoptions.adoptees else (self.link_secret,)

    def expect(self, indexes: list[int], secrets: tuple[str, ...], wait: float) -> None:
        """The instances at ``indexes`` outlived the server before this one, whose ``secrets`` they show: a
        reattached request this broker does not know waits for them up to ``wait`` seconds (they bring theirs)."""
        self.adopted_secrets = secrets
        self.adoptions.expected = {f"w{i}".encode() for i in indexes}
        self.adoptions.adoptees = set(self.adoptions.expected)
        self.adoptions.until = time.monotonic() + wait

    def _adopt(self, entry: WorkerEntry, live: tuple[wire.Live, ...]) -> None:
        """An adoptee registered with the requests it holds, parked: each waits for its client to reattach. It hears
        at once that it was adopted (a HEARTBEAT with this server's pid: it moves its rows into this start's slot
        table, where the next start would look for it)."""
        self.adoptions.expected.discard(entry.identity)
        self._to_worker(entry.identity, wire.Heartbeat(entry.identity.decode(), pid=os.getpid()))
        now = time.monotonic()
        for one in live:
            assign, req = one.assign, one.assign.request
            p = Pending(assign.ticket, b"", req, entry.model, now, None, attempts=assign.attempt,
                        generated=bytearray(one.generated), tokens_known=assign.report_tokens, index=assign.index,
                        tenant=req.tenant, priority=req.priority, first_assigned=now,
                        first_token=now if one.text else 0.0, parked_on=entry.identity,
                        state=RequestState.STREAMING if one.text else RequestState.QUEUED)
            entry.parked.add(p.ticket)
            self.adoptions.hold(p, one.text, now)
        self.stats["adopted_requests"] += len(live)
        log.info("adopted worker %s (pid %d) of the server before this one, holding %d request(s) for their clients",
                 entry.identity.decode(), entry.pid, len(live))
        if not self.adoptions.expected:
            self._release_held()

    def _reattach(self, client: bytes, req: wire.Request, tenant: str) -> bool:
        """A client sent ``req`` again after the server before this one died: if an adoptee holds it (every choice),
        it goes on there, its whole text so far streamed first. False: this broker does not hold it (run it anew)."""
        rows = self.adoptions.take(tenant, req.id)
        if len(rows) != req.params.n or req.model is not None and self._resolve_model(req.model) != rows[0][0].model:
            for p, _ in rows:
                self._forget_adopted(p)
            return False
        now = time.monotonic()
        rows.sort(key=lambda row: row[0].index)
        tickets = tuple(p.ticket for p, _ in rows)
        mq = self.models[rows[0][0].model]
        for p, text in rows:
            p.client, p.request = client, msgspec.structs.replace(p.request, timeout=req.timeout)
            p.group = tickets if len(tickets) > 1 else ()
            p.deadline = now + req.timeout if req.timeout else None
            if p.parked_on not in self.workers:  # its instance was lost meanwhile: it resumes from its tokens
                p.parked_on = None
            self.requests[p.ticket] = p
            if p.deadline is not None:
                heapq.heappush(self._deadlines, (p.deadline, p.ticket))
            if req.stream and text:
                self._to_client(client, wire.encode(wire.Chunk(req.id, text, None, p.index)))
            mq.queue.requeue(p.ticket, tenant, p.priority, p.cost)
        self.by_client[(client, req.id)] = tickets[0]
        self._owned[client] = self._owned.get(client, 0) + len(rows)
        capped = _cap_key(client, tenant)
        self._capped[capped] = self._capped.get(capped, 0) + len(rows)
        self._heard.setdefault(client, now)
        self.stats["reattached"] += 1
        log.debug("request %s of %s: reattached to its adopted sequence(s)", req.id, mq.name)
        self._dispatch(mq.name)
        return True

    def _forget_adopted(self, p: Pending) -> None:
        """An adopted request no client took: its instance forgets it."""
        entry = self.workers.get(p.parked_on) if p.parked_on is not None else None
        if entry is not None:
            entry.parked.discard(p.ticket)
            self._to_worker(entry.identity, wire.Cancel(p.ticket))

    def expire_adoptions(self, now: float) -> None:
        """Forget the adopted requests no client reattached to in time, and stop expecting adoptees past their
        wait (the reattached requests held for them run anew)."""
        for p in self.adoptions.expired(now):
            self.stats["adopted_unclaimed"] += 1
            self._forget_adopted(p)
        if self._held and not self.adoptions.expecting(now):
            self._release_held()

    def adoptee_lost(self, index: int) -> None:
        """Adoptee ``index`` exited, or was killed for not registering in time: it brings nothing."""
        self.adoptions.expected.discard(f"w{index}".encode())
        if not self.adoptions.expected:
            self._release_held()

    def _release_held(self) -> None:
        """The reattached requests held for the adoptees, taken again now that none is expected."""
        held, self._held = self._held, []
        for client, req, tenant, admin in held:
            try:
                self._on_request(client, req, tenant, admin)
            except MpserveError as exc:
                self._to_client(client, wire.encode(wire.Error(req.id, exc.code, exc.message, exc.retry_after)))

    def _chat_verdict(self, msg: wire.Ready, local: bool) -> chat.Verdict:
        mq = self.models[msg.model]
        return chat.judge(chat.Held(mq.chat, mq.chat_local), self.chat_templates.get(msg.model),
                          ChatTemplate(msg.chat_template, msg.bos_token, msg.eos_token), local)

    def _chat_refusal(self, msg: wire.Ready, local: bool) -> str | None:
        """Why a remote pool's READY may not register: its chat template differs from the model's
        (``mpserve.server.chat``)."""
        if local or self._chat_verdict(msg, local) is not chat.Verdict.DIFFERS:
            return None
        mq = self.models[msg.model]
        return chat.differs(msg.model, chat.Held(mq.chat, mq.chat_local))

    def _take_chat(self, identity: bytes, msg: wire.Ready, local: bool) -> None:
        """The template a registering worker brings: taken (a local instance's first, or a pool's that is the
        server's own while none is known), or, if it differs from the model's, logged and counted, never taken."""
        verdict = self._chat_verdict(msg, local)
        mq = self.models[msg.model]
        if verdict is chat.Verdict.TAKE:
            mq.chat, mq.chat_local = ChatTemplate(msg.chat_template, msg.bos_token, msg.eos_token), local
        elif verdict is chat.Verdict.DIFFERS:
            self.stats["chat_template_differs"] += 1
            log.warning("worker %r%s serves model %s with another chat template (or BOS or EOS token text) than the "
                        "one the server hands out; kept that one", identity, f" on {msg.host}" if msg.host else "",
                        msg.model)

    def _answered(self, identity: bytes, msg: wire.Ready) -> bool:
        """Answer a remote worker's READY at once (a heartbeat), so that it hears the broker before its silence
        makes it connect again. Whether it could: a READY that came over a connection already closing registers
        nothing. A remote worker outlives brokers: one that connected again while a restarted broker was not
        reading yet (starting) left such a connection, its READY unread, and ZeroMQ refused the new connection the
        name the old one still held. Registered, the worker would be unreachable and each request sent to it
        handed over; unanswered, it hears nothing, and connects and registers again."""
        if self._send_worker(identity, wire.encode(wire.Heartbeat(identity.decode()))):
            return True
        self.stats["unanswered_ready"] += 1
        log.warning("worker %s%s: its READY came over a connection that is closing; not registered until it "
                    "registers again", identity.decode(), f" on {msg.host}" if msg.host else "")
        return False

    def _worker_left(self, entry: WorkerEntry, reason: str) -> None:
        """A worker said it is exiting (LEAVING): it is forgotten now, not after its silence or its reaping, and
        the requests it ran are handed over."""
        self.stats["worker_left"] += 1
        where = f" on {entry.host}" if entry.index is None else ""
        log.info("worker %s%s is leaving (%s)%s", entry.identity.decode(), where, reason,
                 f"; handing over {len(entry.running)} request(s)" if entry.running else "")
        self._worker_gone(entry, f"worker {entry.identity.decode()}{where} stopped ({reason})", crashed=False)

    def _forget_worker(self, entry: WorkerEntry) -> None:
        if self.workers.get(entry.identity) is not entry:
            return
        del self.workers[entry.identity]
        self._assigns.pop(entry.identity, None)  # their requests are settled by the caller, by the retry rules
        mq = self.models[entry.model]
        mq.instances -= 1
        mq.free = deque(f for f in mq.free if f[0] != entry.identity)
        self._unpin(entry)

    def _worker_result(self, identity: bytes, mtype: wire.MsgType, ticket: str, type_frame: bytes,
                       body: bytes, trailer: bytes | None) -> None:
        entry = self.workers.get(identity)
        if trailer is not None and entry is not None and mtype not in (wire.MsgType.CHUNK, wire.MsgType.PARKED):
            self._cache_changed(entry, trailer)  # whether or not the request is still there
        p = self._running_on(entry, ticket)
        if p is None or entry is None:
            return
        if self._foreign(p, mtype, body):
            if mtype is wire.MsgType.CHUNK:
                return
            mtype, type_frame, body = wire.MsgType.ERROR, b"", b""  # answered already: only the slot is freed
        if mtype is wire.MsgType.CHUNK:
            if self._streaming(p, trailer):
                self._to_client(p.client, [wire.VERSION, type_frame, body])
            return
        if mtype is wire.MsgType.PARKED:
            self._on_parked(entry, p, trailer)
            return
        slot = entry.running.pop(ticket)
        self._left_slot(p)
        mq = self.models[entry.model]
        if mtype is wire.MsgType.DONE:  # the engine works: its model's crash streak starts afresh
            mq.crash_streak = 0
            mq.crashed.clear()
            self._used(p, body)
        if not p.answered:
            p.state = RequestState.ANSWERED
            self.stats["done" if mtype is wire.MsgType.DONE else "worker_error"] += 1
            if mtype is wire.MsgType.DONE and p.attempts > 1:
                body = _timed_whole(p, body)
            self._to_client(p.client, [wire.VERSION, type_frame, body])
            if mtype is wire.MsgType.ERROR:
                self._end_other_choices(p, ErrorCode.CANCELLED, "another choice of the request failed")
        service_ms = (time.monotonic() - p.assigned) * 1000
        mq.service_ms = service_ms if not mq.service_ms else 0.9 * mq.service_ms + 0.1 * service_ms
        self._finish(p)
        if entry.draining:
            self._stop_if_drained(entry)
        elif not p.preempting:  # a request that ended before its PREEMPT came: its slot is given already
            mq.free.append((identity, slot))
        self._dispatch_freed(entry.model, p.tenant)

    def _dispatch_freed(self, model: str, tenant: str) -> None:
        """A request of ``tenant`` left a slot of ``model``: dispatch that model, and the others where the tenant
        waits at its max_running (its running count is one for all models)."""
        self._dispatch(model)
        if self.ledger.settings(tenant).max_running is not None:
            for name, mq in self.models.items():
                if name != model and mq.queue.waiting(tenant):
                    self._dispatch(name)

    def dispatch_all(self) -> None:
        """Every model's queue looked at again (a reload changed the tenants' limits)."""
        for name in self.models:
            self._dispatch(name)

    def _cache_changed(self, entry: WorkerEntry, frame: bytes) -> None:
        """A CACHE frame: what the worker's host store gained and lost, for routing."""
        try:
            entry.ram.apply(wire.frame_cache(frame))
        except MpserveError as exc:
            self.stats["dropped_worker_malformed"] += 1
            log.error("dropped a bad CACHE frame from worker %r: %s", entry.identity, exc)

    def _cache_held(self, entry: WorkerEntry, frame: bytes | None) -> None:
        """A READY's CACHE frame, or none: what the worker's host store holds (added to what other instances on
        that host told: the view is the host's)."""
        if frame is not None:
            self._cache_changed(entry, frame)

    def _worker_step(self, identity: bytes, batch: bytes) -> None:
        """A worker's STEP, entry by entry in order: each client gets the step's chunks meant for it as one
        message, before its next DONE or ERROR."""
        try:
            entries = wire.step_entries(batch)
        except MpserveError as exc:
            self.stats["dropped_worker_malformed"] += 1
            log.error("dropped a bad STEP from worker %r: %s", identity, exc)
            return
        entry = self.workers.get(identity)
        by_client: dict[bytes, list[bytes]] = {}
        for mtype, ticket, body, trailer in entries:
            if mtype is wire.MsgType.CHUNK:
                p = self._running_on(entry, ticket)
                if p is not None and not self._foreign(p, mtype, body) and self._streaming(p, trailer):
                    by_client.setdefault(p.client, []).append(body)
                continue
            p = self.requests.get(ticket)
            if p is not None and p.client in by_client:
                self._send_chunks(p.client, by_client.pop(p.client))
            self._worker_result(identity, mtype, ticket, wire.TYPE_FRAMES[mtype], body, trailer)
        for client, bodies in by_client.items():
            self._send_chunks(client, bodies)

    def _send_chunks(self, client: bytes, bodies: list[bytes]) -> None:
        if len(bodies) == 1:
            self._to_client(client, [wire.VERSION, CHUNK_FRAME, bodies[0]])
        else:
            self._to_client(client, [wire.VERSION, CHUNKS_FRAME, wire.splice_array(bodies)])

    def _running_on(self, entry: WorkerEntry | None, ticket: str) -> Pending | None:
        """The request ``ticket`` if ``entry`` runs it; else None, counted as a stale result (the request
        ended, or was handed to another worker)."""
        p = self.requests.get(ticket)
        if p is None or entry is None or ticket not in entry.running:
            self.stats["dropped_stale_result"] += 1
            return None
        return p

    def _foreign(self, p: Pending, mtype: wire.MsgType, body: bytes) -> bool:
        """Whether a worker's answer for ``p`` is malformed or names another request: then ``p`` ends now with
        ERROR ``internal`` (a running one is cancelled on its worker), counted, instead of a body its client
        would drop while it waits for its timeout."""
        if p.answered:
            return False
        why = link.foreign(mtype, body, p.request.id)
        if why is None:
            return False
        self.stats["worker_malformed_result"] += 1
        log.error("worker %r sent %s for request %s; ending it", p.worker, why, p.request.id)
        message = f"the instance running this request sent {why}; see the server log"
        if mtype is wire.MsgType.CHUNK:
            self._cancel(p, ErrorCode.INTERNAL, message)
        else:
            self._answer_error(p, ErrorCode.INTERNAL, message)
        return True

    def _streaming(self, p: Pending, tokens: bytes | None) -> bool:
        """A CHUNK of ``p`` arrived: note its tokens; whether it goes on to the client."""
        if p.answered:
            return False
        p.state = RequestState.STREAMING
        p.first_token = p.first_token or time.monotonic()
        if tokens is not None and len(tokens) % 4 == 0:  # int32 ids
            p.generated += tokens
        else:  # an older worker, or a bad frame: a hand-over would miss tokens
            p.tokens_known = False
        return True

    def _dispatch(self, model: str) -> None:
        """Assign queued requests of ``model`` to its free slots, oldest request first."""
        if self.residency is not None:
            self._dispatch_resident()
            return
        mq = self.models[model]
        passed: set[str] = set()  # parked requests whose instance has no slot free: the requests behind pass them
        while mq.queue and mq.free:
            ticket = mq.queue.head(self.ledger.eligible, passed)
            if ticket is None:  # every tenant waiting is at its max_running, or passed
                break
            p = self.requests[ticket]
            if mq.adapters:  # a younger request of its tenant may go first, to batch with an instance's adapters
                p = self._batching_next(mq, p)
            slots = self._take_slots(mq, p)
            if slots is None and p.parked_on is not None:
                passed.add(p.ticket)
                continue
            if slots is None and not self._refuse_head(mq, p):  # a request for n waits for n slots of one instance
                break
            if slots is not None:
                mq.queue.pop(p.ticket)
                self._assign_choices(p, slots)
        self._preempt_for(mq)

    def _dispatch_resident(self) -> None:
        """Single active backend: advance each device's turn (unloading what must leave), then start the
        resident model's queued requests on that device's free slots."""
        assert self.residency is not None
        for device in sorted({w.device for w in self.workers.values()}):
            here = [w for w in self.workers.values() if w.device == device]
            models = {w.model for w in here}
            waiting = sorted((m for m in models if self.models[m].queue),
                             key=lambda m: self.requests[self.models[m].queue.oldest()].accepted)
            running = Counter(w.model for w in here for _ in w.running)
            loaded = [Loaded(w.identity, w.model, w.unloading) for w in here if w.loaded]
            for identity in self.residency.decide(device, waiting, running, loaded):
                self.workers[identity].unloading = True
                self._to_worker(identity, wire.Unload("another model takes the device"))
            for model in models:
                mq = self.models[model]
                while mq.queue and self.residency.allows(device, model):
                    ticket = mq.queue.head(self.ledger.eligible)
                    if ticket is None:
                        break
                    p = self.requests[ticket]
                    slots = self._take_slots(mq, p, device)
                    if slots is None:
                        if self._refuse_head(mq, p):
                            continue
                        break
                    mq.queue.pop(ticket)
                    for _ in slots:
                        self.residency.started(device)
                    self._assign_choices(p, slots)

    def _take_slots(self, mq: ModelQueue, p: Pending, device: int | None = None) -> list[tuple[bytes, int]] | None:
        """Take the free slot ``routing.choose_slot`` picks (on ``device``, if given), or for a request for n
        the n slots of one instance ``routing.choose_slots`` picks; count why (``routed_kv_prefix``, ...)."""
        names = {name for name, _ in p.request.adapters}
        free = [f for f in mq.free if names <= self.workers[f[0]].adapters] if names else mq.free  # those loaded
        if p.parked_on is not None:  # where its sequence is held
            free = [f for f in free if f[0] == p.parked_on]
        route = choose_slots(free, self.workers, p.request.prompt, p.slots_needed, device, self._blocks(mq, p),
                             _salt(p), p.request.adapters, self._adapter_sets(mq))
        if route is None:
            return None
        for slot in route.slots:
            mq.free.remove(slot)
        self.stats[f"routed_{route.source.value}"] += 1
        return route.slots

    def _batching_next(self, mq: ModelQueue, head: Pending) -> Pending:
        """The queued request ``routing.pick_queued`` sends next, of those of ``head``'s tenant and priority (the
        fair queue chose them: another tenant's never goes first for batching); the oldest counts each time it is
        passed over."""
        sets = self._adapter_sets(mq) or {}
        free = {w for w, _ in mq.free}
        alone = {next(iter(s)) for w, s in sets.items() if w in free and len(s) == 1}
        line = mq.queue.line(head.tenant, head.priority)
        if not line or line[0] != head.ticket:  # put back after a preemption or a loss: it goes as it is
            return head
        window = [self.requests[t] for t in itertools.islice(line, QUEUE_WINDOW)]
        chosen = window[pick_queued([(p.request.adapters, p.passed) for p in window], alone)]
        if chosen is not window[0]:
            window[0].passed += 1
        return chosen

    def _adapter_sets(self, mq: ModelQueue) -> dict[bytes, set[tuple[tuple[str, float], ...]]] | None:
        """The LoRA adapter sets each instance of the model runs requests of (``routing.affinity``); None for a
        model without adapters."""
        if not mq.adapters:
            return None
        return {w.identity: {self.requests[t].request.adapters for t in w.running if t in self.requests}
                for w in self.workers.values() if w.model == mq.name}

    def _blocks(self, mq: ModelQueue, p: Pending) -> tuple[int, ...]:
        """``p``'s prompt's block hashes, for routing by what the instances' host stores hold: computed once per
        request, and only once some free instance holds anything in its cache."""
        if p.blocks is None:
            if len(p.request.prompt) < PREFIX_BLOCK or not any(self.workers[w].ram for w, _ in mq.free):
                return ()
            p.blocks = block_hashes(p.request.prompt, _salt(p))
        return p.blocks

    def _refuse_head(self, mq: ModelQueue, p: Pending) -> bool:
        """A request for more choices than any instance now registered has slots (they came after it was
        accepted) would hold the queue up for ever: answer it. Whether it was."""
        refusal = self._too_many_choices(mq, p.slots_needed)
        if refusal is not None:
            mq.queue.remove(p.ticket)
            self._answer_error(p, ErrorCode.BAD_REQUEST, refusal)
        return refusal is not None

    def _assign_choices(self, p: Pending, slots: list[tuple[bytes, int]]) -> None:
        """Start ``p`` in ``slots[0]``; a request for n starts all its choices, one per slot (a choice retried
        after a worker died is queued on its own and needs one)."""
        choices = self._choices(p) if p.slots_needed > 1 else [p]
        p.slots_needed = 1
        for choice, slot in zip(choices, slots, strict=True):
            self._assign(choice, slot)

    def _assign(self, p: Pending, slot: tuple[bytes, int]) -> None:
        identity, index = slot
        entry = self.workers[identity]
        entry.parked.discard(p.ticket)  # parked there: the ASSIGN under its ticket resumes it
        p.parked_on = None
        p.preempting = False  # a PREEMPT that went to a worker lost meanwhile concerns this run no more
        p.attempts += 1
        p.state = RequestState.RUNNING
        p.worker = identity
        p.assigned = time.monotonic()
        self.ledger.started(p.tenant, 0.0 if p.first_assigned else p.assigned - p.accepted)
        p.first_assigned = p.first_assigned or p.assigned
        entry.running[p.ticket] = index
        entry.prompts[index] = (_salt(p), p.request.prompt)
        entry.loaded = True  # an unloaded worker loads its model for the request
        log.debug("request %s of %s: started on worker %s, attempt %d", p.request.id, p.model, identity.decode(),
                  p.attempts)
        body = wire.pack(wire.Assign(p.ticket, p.request, (time.monotonic() - p.accepted) * 1000, p.attempts,
                                     slot=index, report_tokens=True, generated=bytes(p.generated), index=p.index,
                                     salt=_salt(p)))
        waiting = self._assigns.setdefault(identity, [])
        if waiting and sum(map(len, waiting)) + len(body) > wire.MAX_MESSAGE_BYTES:
            self._flush_assigns(identity)
            waiting = self._assigns.setdefault(identity, [])
        waiting.append(body)
        if len(waiting) >= ASSIGN_BATCH:
            self._flush_assigns(identity)

    # --- priority and preemption ---------------------------------------------------------------

    def _preempt_for(self, mq: ModelQueue) -> None:
        """Requests of ``mq`` wait and none of its slots is free: preempt the running requests
        ``preemption.victims`` picks. Each victim's worker gets PREEMPT, then the ASSIGN of the waiting request it
        gives way to, into its slot: the worker parks one and admits the other in the same turn."""
        if not mq.queue or mq.free or mq.failed is not None:
            return
        running, room = [], {}
        for entry in self.workers.values():
            if entry.model != mq.name or entry.draining:
                continue
            room[entry.identity] = entry.capacity - len(entry.parked)
            for ticket in entry.running:
                p = self.requests.get(ticket)
                if p is None or p.answered:
                    continue
                if p.preempting:
                    room[entry.identity] -= 1
                else:
                    running.append(preemption.Running(ticket, p.priority, p.first_assigned, p.preemptions,
                                                      entry.identity))
        if not running:
            return
        waiting: list[Pending] = []
        for ticket in mq.queue.above(min(r.priority for r in running)):  # only those above the lowest running one
            p = self.requests[ticket]
            if len(waiting) == len(running):
                break
            if p.parked_on is None and p.slots_needed == 1 and self.ledger.may_start(p.tenant) and all(
                    {name for name, _ in p.request.adapters} <= self.workers[w].adapters for w in room):
                waiting.append(p)  # (one whose adapters some instance has not loaded yet waits for a free slot)
        chosen = preemption.victims([p.priority for p in waiting], running, room)
        for p, ticket in zip(waiting, chosen, strict=False):
            victim = self.requests[ticket]
            identity = victim.worker
            assert identity is not None
            victim.preempting = True
            log.debug("request %s of %s: preempted on worker %s for request %s", victim.request.id, mq.name,
                      identity.decode(), p.request.id)
            self._to_worker(identity, wire.Preempt(ticket))
            mq.queue.remove(p.ticket)
            self._assign(p, (identity, self.workers[identity].running[ticket]))

    def _on_parked(self, entry: WorkerEntry, p: Pending, tokens: bytes | None) -> None:
        """PARKED: ``entry`` holds ``p``'s sequence (its slot serves the request it gave way to); ``p`` is queued
        again at its priority, to resume there (a request cancelled meanwhile is forgotten there too)."""
        del entry.running[p.ticket]
        p.worker = None
        p.preempting = False
        mq = self.models[entry.model]
        if p.answered or entry.draining:  # a draining worker's: it resumes elsewhere, from its tokens
            self._to_worker(entry.identity, wire.Cancel(p.ticket))
        if p.answered:  # cancelled or timed out while its PREEMPT went: it ran until now
            self._left_slot(p)
            self._finish(p)
            self._dispatch_freed(entry.model, p.tenant)
            return
        if tokens is not None and len(tokens) % 4 == 0:
            p.generated += tokens
        elif tokens is not None:
            p.tokens_known = False
        self._left_slot(p)
        p.state = RequestState.QUEUED
        p.preemptions += 1
        if not entry.draining:
            p.parked_on = entry.identity
            entry.parked.add(p.ticket)
        self._count_preemption(mq, p)
        mq.queue.requeue(p.ticket, p.tenant, p.priority, p.cost)  # first of its priority, not charged again
        self._dispatch(entry.model)

    def _count_preemption(self, mq: ModelQueue, p: Pending) -> None:
        """Count ``p``'s preemption: in all, per model and per tenant."""
        self.stats["preempted"] += 1
        mq.preempted += 1
        self.ledger.preempted(p.tenant)
        log.debug("request %s of %s: parked (preempted %d time(s)), queued again", p.request.id, p.model,
                  p.preemptions)

    def _unpark(self, p: Pending) -> None:
        """``p`` ends while parked: its worker forgets its sequence."""
        if p.parked_on is None:
            return
        entry = self.workers.get(p.parked_on)
        p.parked_on = None
        if entry is not None:
            entry.parked.discard(p.ticket)
            self._to_worker(entry.identity, wire.Cancel(p.ticket))

    def _unpin(self, entry: WorkerEntry) -> None:
        """``entry`` no longer holds the sequences parked on it (it was lost, or unloaded its model): those
        requests resume on any instance, from the tokens they streamed."""
        for ticket in entry.parked:
            p = self.requests.get(ticket)
            if p is not None and p.parked_on == entry.identity:
                p.parked_on = None
        entry.parked.clear()

    def _flush_assigns(self, identity: bytes) -> None:
        bodies = self._assigns.pop(identity, None)
        if bodies and not self._send_worker(identity, wire.encode_assigns(bodies)):
            self._undelivered.add(identity)

    def _to_worker(self, identity: bytes, msg: object) -> None:
        """Send ``msg`` after the ASSIGNs still gathered for that worker (a CANCEL never passes its ASSIGN)."""
        self._flush_assigns(identity)
        self._send_worker(identity, wire.encode(msg))

    def _send_worker(self, identity: bytes, frames: list[bytes]) -> bool:
        """Whether ``frames`` went to the worker's link (ZeroMQ queued them)."""
        try:
            zmqio.send(self.back, [identity, *frames], zmqio.NOBLOCK)
        except (zmq.Again, zmq.ZMQError) as exc:
            self._unreachable(identity, exc)
            return False
        return True

    def _unreachable(self, identity: bytes, exc: zmq.ZMQError) -> None:
        """A send to a worker failed: it died or its link is down. Said once until it is heard from again: a
        local worker's sentinel settles its requests, a remote one's silence (``expire_workers``)."""
        entry = self.workers.get(identity)
        if entry is None or entry.unreachable:
            return
        entry.unreachable = True
        if entry.index is not None:
            log.warning("cannot send to worker %s (%s); waiting for the supervisor to reap it", identity.decode(), exc)
        else:
            expiry = self.heartbeat_interval * self.heartbeat_liveness
            log.warning("cannot send to worker %s on %s (%s): its link is down; it is declared lost if it stays "
                        "silent for %.1f s, or at once if a request was not sent", identity.decode(), entry.host, exc,
                        expiry)

    def _left_slot(self, p: Pending) -> None:
        """``p`` no longer holds its slot (it ended, or its worker was lost): its tenant's running count drops, and
        its tenant is charged the slot time it used beyond (or short of) its cost."""
        p.worker = None
        self.ledger.stopped(p.tenant)
        self.models[p.model].queue.charge(p.tenant, time.monotonic() - p.assigned - p.cost)

    def _used(self, p: Pending, done: bytes) -> None:
        """``p`` ended with DONE ``done``: its tokens count for its tenant."""
        usage = wire.peek_usage(done)
        if usage is not None:
            self.ledger.used(p.tenant, usage.prompt_tokens, usage.completion_tokens, time.monotonic())

    def _stale_deadline(self, ticket: str) -> bool:
        p = self.requests.get(ticket)
        return p is None or p.answered


def _cap_key(client: bytes, tenant: str) -> bytes:
    """Whose pending requests max_pending_per_client counts: a client's, but the gateway's (on the admin socket)
    per tenant it names, so that one of its callers cannot fill the gateway's share for all."""
    return b"\0tenant:" + tenant.encode() if tenant and roles.is_admin(client) else client


def new_ticket() -> str:
    """The name a request or lookup goes by between the broker and its worker: random, so that no other peer of the
    worker socket can guess it (a worker's answer counts only under a ticket the broker gave it)."""
    return secrets.token_urlsafe(TICKET_BYTES)


def _timed_whole(p: Pending, body: bytes) -> bytes:
    """The DONE of a request that was handed over, its timings made the whole request's, as its client saw it
    (the worker's cover its own part only): queued from accepted until first assigned, then until the first token
    the client got (or, if none was streamed, this worker's), and generating from there until now, across the
    hand-over. A body that does not decode goes on as it came."""
    try:
        done = wire.decode_body(wire.MsgType.DONE, body)
    except MpserveError:
        return body
    assert isinstance(done, wire.Done)
    now = time.monotonic()
    first = p.first_token or p.assigned + done.timings.prompt_ms / 1000
    timings = dataclasses.replace(done.timings, queue_ms=(p.first_assigned - p.accepted) * 1000,
                                  prompt_ms=(first - p.first_assigned) * 1000, generate_ms=max(0.0, now - first) * 1000)
    return wire.pack(msgspec.structs.replace(done, timings=timings))


def crash_verdict(sig: Signals) -> str:
    """Why a model whose workers crash on every request failed, and what to try (after "model NAME ")."""
    return (f"crashed its workers with {sig.name} on {MODEL_CRASHES} different requests in a row, none done "
            "between: its engine fails on this host, whatever the request. Try the model with repack: false "
            "(--no-repack; llama.cpp's repacked CPU kernels crash on some AMX and AVX-512 hosts), or with other "
            "n_gpu_layers or flash_attn settings, then restart the server")


def _no_control(msg: wire.Control) -> wire.ControlReply:
    raise BadRequest("this server takes no control calls")


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


def _salt(p: Pending) -> bytes:
    """``p``'s reuse namespace (``mpserve.wire.salt``), computed once: what routing matches its prompt under, and
    what its worker reuses cells under."""
    if p.salt is None:
        p.salt = reuse_salt(p.request.tenant, p.request.cache_salt, p.request.adapters)
    return p.salt
