"""The clients' side of the broker: each message from the front (or, as an operator, the admin socket), admission,
tenants, lookups and reattached requests.

    client message ─▶ message: its type allowed to its socket (``roles``) ─▶ REQUEST: admit ─┐ CANCEL: cancel it
        PING: PONG (this start's id)  STATS_QUERY: snapshot  TOKENIZE, EMBED, SLOT_ACTION: a lookup, at once to one
        instance  ADAPTER_ACTION: ``AdapterOps``  CONTROL: hooks.control
    admit ─▶ reattach? (``Rebinder``: a gone client's request, taken up, or contested while its client is not found
        gone: asked again each CONTEST_RETRY_S; ``Adopter``: an adoptee holds it; or held while adoptees are
        expected) ─▶ its model, its adapters, the limits (queue, server, per client, per tenant:
        ``tenants.Ledger``, and the tenant's image limits) ─▶ Busy / BadRequest ...
        ─▶ or n rows in the tables, queued (its tenant's priority and cost) ─▶ the dispatcher
    a request's tenant: on the clients' socket its connection's (a CURVE client's key; "" on ipc), on the admin
        socket the ``tenant`` the gateway names (``_tenant``); its priority is capped by its tenant's settings

A refusal is an ERROR naming its code at once; nothing waits in silence. Clients that went silent past
``client_timeout`` lose their requests (``expire``).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import Counter

import msgspec

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
)
from mpserve.wire import adapters as wire_adapters
from mpserve.wire import protocol as wire
from mpserve.wire.media import check_images

from . import roles
from .adapter_ops import AdapterOps
from .adopter import Adopter
from .answers import Answers
from .dispatch import Dispatcher
from .hooks import BrokerHooks
from .rebind import Claim, Rebinder
from .state import ModelQueue, Pending
from .tables import DEFAULT_SERVICE_MS, Tables, WorkerOutbox, cap_key, new_ticket
from .tenants import shown

log = logging.getLogger("mpserve.broker")

CONTEST_RETRY_S = 0.05  # how often a contested claim is asked again (each time, a PONG probes the other client)
FROM_CLIENTS = {wire.MsgType.REQUEST, wire.MsgType.CANCEL, wire.MsgType.PING, wire.MsgType.TOKENIZE,
                wire.MsgType.EMBED, wire.MsgType.STATS_QUERY, wire.MsgType.SLOT_ACTION, wire.MsgType.ADAPTER_ACTION,
                wire.MsgType.CONTROL}


class Clients:
    """Admission and the clients' messages; the reattached requests held while adoptees are expected."""

    def __init__(self, tables: Tables, dispatcher: Dispatcher, adopter: Adopter, adapter_ops: AdapterOps,
                 hooks: BrokerHooks, *, max_queue_total: int, max_pending_per_client: int,
                 client_timeout: float) -> None:
        """The limits as ``Broker`` takes them."""
        self.tables = tables
        self.dispatcher = dispatcher
        self.answers: Answers = dispatcher.answers
        self.outbox: WorkerOutbox = dispatcher.outbox
        self.adopter = adopter
        self.adapter_ops = adapter_ops
        self.hooks = hooks
        self.max_queue_total = max_queue_total
        self.max_pending_per_client = max_pending_per_client
        self.client_timeout = client_timeout
        self.start_id = secrets.token_hex(8)  # this start, in every PONG: a client that sees another one reattaches
        self.held: list[tuple[bytes, wire.Request, str, bool, float]] = []  # reattached, waiting for the adoptees
        self.contested: list[tuple[bytes, wire.Request, str, bool, float]] = []  # reattached, claiming a live
        # request of a client not found gone yet (``Claim.WAIT``), and when they claimed it
        self._next_contest = 0.0
        self.rebinder = Rebinder(tables, self.answers, lambda: wire.encode(self._pong()))  # live requests of gone
        # clients, taken up by others

    def message(self, frames: list[bytes], tenant: str = "", admin: bool = False) -> None:
        """One message from a client; ``tenant``: its connection's (the CURVE key it proved), on the front."""
        if len(frames) < 2:
            self.tables.stats["dropped_malformed"] += 1
            return
        client, frames = frames[0], frames[1:]
        if client in self.tables.heard:
            self.tables.heard[client] = self.tables.spoke[client] = time.monotonic()
        if self.tables.detached:  # found gone, and back under the same routing id: it is sent to again
            self.tables.detached.pop(client, None)
        try:
            mtype = wire.parse_header(frames, 3)
            if mtype not in FROM_CLIENTS:
                raise ProtocolError(f"a client may not send {mtype.name} messages")
            roles.check(mtype, admin)
            msg = wire.decode_body(mtype, frames[2])
            if isinstance(msg, wire.Request):
                self.admit(client, msg, self._tenant(msg, tenant, admin), admin)
            elif isinstance(msg, wire.Cancel):
                self._cancel_request(client, msg)
            elif isinstance(msg, wire.Ping):
                self.answers.to_client(client, wire.encode(self._pong(msg.nonce)))
            elif isinstance(msg, wire.Tokenize):
                self._lookup(client, msg)
            elif isinstance(msg, wire.Embed):
                self._embed(client, msg)
            elif isinstance(msg, wire.StatsQuery):  # a keyed client reads its own tenant's figures, not others'
                self.answers.to_client(client, wire.encode(self.snapshot(msg.nonce, "" if admin else tenant)))
            elif isinstance(msg, wire.SlotAction):
                self._slot_action(client, msg)
            elif isinstance(msg, wire.AdapterAction):
                self.adapter_ops.start(client, msg)
            else:  # CONTROL, the last of FROM_CLIENTS
                self.answers.to_client(client, wire.encode(self.hooks.control(msg)))
        except MpserveError as exc:
            self.tables.stats[f"rejected_{exc.code}"] += 1
            rid = wire.peek_id(frames[2]) if len(frames) == 3 else None
            self.answers.to_client(client, wire.encode(wire.Error(rid, exc.code, exc.message, exc.retry_after)))
        except Exception:  # a bug: log it loudly, answer, and keep serving everyone else
            log.exception("internal error while handling a client message")
            self.tables.stats["internal_error"] += 1
            rid = wire.peek_id(frames[2]) if len(frames) == 3 else None
            self.answers.to_client(client, wire.encode(wire.Error(rid, ErrorCode.INTERNAL,
                                                                  "internal error; see the server log")))

    def _pong(self, nonce: int = 0) -> wire.Pong:
        """What a PING is answered (the largest message: clients check it; this start's id: they reattach on
        another)."""
        return wire.Pong(nonce, tuple(self.tables.models), wire.MAX_MESSAGE_BYTES, self.start_id)

    def _tenant(self, req: wire.Request, connection: str, admin: bool) -> str:
        """Whose ``req`` is: on the admin socket, the tenant it names (the gateway's caller); on the clients'
        socket, its connection's (a ``tenant`` naming another is refused)."""
        if admin:
            return req.tenant
        if req.tenant in ("", connection):
            return connection
        raise Forbidden(f"'tenant' is named only over the server's admin socket (the gateway's); on this socket a "
                        f"request is its connection's, {shown(connection)}: leave 'tenant' out")

    def admit(self, client: bytes, req: wire.Request, tenant: str = "", admin: bool = False,
              since: float | None = None) -> None:
        """A REQUEST of ``tenant``: taken up where another client or an adoptee holds it (reattached; ``since``:
        when it first claimed it), held while that is not settled, refused (an MpserveError: its ERROR), or
        queued."""
        if not self.tables.accepting:
            raise ShuttingDown("the server is shutting down; retry after it restarts", retry_after=1.0)
        if (client, req.id) in self.tables.by_client:
            if req.reattach:  # it reached this start already (sent as the client reconnected): it runs here
                return
            raise BadRequest(f"request id {req.id!r} is already in use by one of your pending requests")
        if req.reattach and self._reattached(client, req, tenant, admin, time.monotonic() if since is None else since):
            return
        model = self.tables.resolve_model(req.model)
        self._queue(client, self._admissible(client, req, model, tenant), model, tenant)

    def _reattached(self, client: bytes, req: wire.Request, tenant: str, admin: bool, since: float) -> bool:
        """Whether ``req`` (marked reattach) was taken up where it runs, or held until that is settled: contested
        while the client that has it is not found gone, held while adoptees are expected (its instance may not
        have registered yet)."""
        claim = self.rebinder.rebind(client, req, tenant, since)
        if claim is Claim.TAKEN or self.adopter.reattach(client, req, tenant):
            return True
        if claim is Claim.WAIT:
            self.contested.append((client, req, tenant, admin, since))
            return True
        if self.adopter.adoptions.expecting(time.monotonic()):
            self.held.append((client, req, tenant, admin, since))
            return True
        return False

    def _admissible(self, client: bytes, req: wire.Request, model: str, tenant: str) -> wire.Request:
        """``req`` as it is queued (its adapters in their one form), or the refusal it gets, raised."""
        mq = self.tables.models[model]
        if req.adapters:  # one set, however written: sorted, each served (``mpserve.wire.adapters``)
            unserved = wire_adapters.unknown(req.adapters, mq.adapters, model)
            if unserved is not None:
                raise unserved
            unloaded = self.adapter_ops.refusal(model, req.adapters)
            if unloaded is not None:  # served, but no instance has it nor will: it would wait for its timeout
                raise unloaded
            req = msgspec.structs.replace(req, adapters=wire_adapters.normal(req.adapters))
        if model in self.tables.embedding_models:
            raise BadRequest(f"model {model} is an embedding model (embedding: true in its models[] entry): it "
                             "computes embeddings (/v1/embeddings, Client.embed), not completions")
        if mq.failed is not None:
            raise ModelFailed(mq.refusal())
        if len(mq.queue) >= mq.max_queue and not mq.free:
            raise Busy(f"the queue of model {model} is full ({mq.max_queue} waiting); try again later",
                       retry_after=self.tables.retry_after(mq))
        if self.tables.queued() >= self.max_queue_total:
            raise Busy(f"the server has {counted(self.max_queue_total, 'request')} waiting; try again later",
                       retry_after=self.tables.retry_after(mq))
        capped = cap_key(client, tenant)
        if self.tables.capped.get(capped, 0) >= self.max_pending_per_client:
            whose = f"tenant {shown(tenant)} has" if capped != client else "you have"
            raise Busy(f"{whose} {counted(self.max_pending_per_client, 'request')} pending, the most one client may "
                       "have (max_pending_per_client); wait for some to finish",
                       retry_after=self.tables.retry_after(mq))
        images = self.tables.ledger.settings(tenant).images(shown(tenant))
        if req.images and images is not None:  # the tenant's image limits, below the gateway's (checked there)
            check_images(req.images, images)
        n = req.params.n
        refusal = self.tables.too_many_choices(mq, n) if n > 1 else None  # one choice fits any instance
        if refusal is not None:
            raise BadRequest(refusal)
        return req

    def _queue(self, client: bytes, req: wire.Request, model: str, tenant: str) -> None:
        """``req`` accepted: one row per choice in the tables, the first queued for all n at its tenant's priority
        and cost; then the model's queue is dispatched."""
        mq, n, now = self.tables.models[model], req.params.n, time.monotonic()
        if self.tables.ledger.limited(tenant):
            would_wait = bool(mq.queue) or len(mq.free) < n or not self.tables.ledger.may_start(tenant, n)
            self.tables.ledger.admit(tenant, self.tables.waiting(tenant), would_wait, now)
        priority = self.tables.ledger.priority(tenant, req.priority)
        if req.tenant != tenant or req.priority != priority:  # what the worker and routing see is what holds
            req = msgspec.structs.replace(req, tenant=tenant, priority=priority)
        cost = (mq.service_ms or DEFAULT_SERVICE_MS) / 1000
        self.tables.heard.setdefault(client, now)
        tickets = tuple(new_ticket() for _ in range(n))
        for i, ticket in enumerate(tickets):  # a request for n: one row per choice, with its own parameters
            one = req if n == 1 else msgspec.structs.replace(req, params=req.params.choice_params(i))
            p = Pending(ticket, client, one, model, now, now + req.timeout if req.timeout else None,
                        group=tickets if n > 1 else (), index=i, tenant=tenant, priority=priority, cost=cost)
            self.tables.requests[ticket] = p
            self.tables.add_deadline(p)
            self.tables.journal.begin(p)
        self.tables.requests[tickets[0]].slots_needed = n
        self.tables.bind(client, self.tables.requests[tickets[0]])
        self.tables.owned[client] = self.tables.owned.get(client, 0) + n
        capped = cap_key(client, tenant)
        self.tables.capped[capped] = self.tables.capped.get(capped, 0) + n
        self.tables.stats["accepted"] += 1
        self.tables.ledger.accepted(tenant)
        mq.queue.append(tickets[0], tenant, priority, cost * n)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s of %s (tenant %s, priority %d): queued, %d waiting", req.id, model, shown(tenant),
                      priority, len(mq.queue))
        self.dispatcher.dispatch(model)

    def _lookup(self, client: bytes, msg: wire.Tokenize | wire.Embed) -> None:
        """To the least busy instance of the model that has it loaded: the worker answers between steps."""
        if not self.tables.accepting:
            raise ShuttingDown("the server is shutting down; retry after it restarts", retry_after=1.0)
        model = self.tables.resolve_model(msg.model)
        loaded = [w for w in self.tables.workers.values() if w.model == model and w.loaded and not w.unloading]
        if not loaded:
            raise Busy(f"no instance of model {model} has it loaded now; retry once one has", retry_after=1.0)
        worker = min(loaded, key=lambda w: len(w.running))
        ticket = new_ticket()
        self.tables.lookups[ticket] = (client, msg.id, worker.identity)
        self.tables.stats["tokenize" if isinstance(msg, wire.Tokenize) else "embed"] += 1
        self.outbox.to_worker(worker.identity, msgspec.structs.replace(msg, ticket=ticket))

    def _embed(self, client: bytes, msg: wire.Embed) -> None:
        """As TOKENIZE, for embedding models only."""
        model = self.tables.resolve_model(msg.model)
        if model not in self.tables.embedding_models:
            raise BadRequest(f"model {model} is not an embedding model: serve one with embedding: true in its "
                             "models[] entry to ask it for embeddings")
        self._lookup(client, msg)

    def _slot_action(self, client: bytes, msg: wire.SlotAction) -> None:
        """To the instance it names: the worker acts on an idle slot between steps."""
        worker = self.tables.workers.get(msg.worker.encode())
        if worker is None or not worker.loaded:
            raise BadRequest(f"no loaded instance {msg.worker!r}; `mpserve status` lists the instances and slots")
        ticket = new_ticket()
        self.tables.lookups[ticket] = (client, msg.id, worker.identity)
        self.tables.stats[f"slot_{msg.action}"] += 1
        self.outbox.to_worker(worker.identity, msgspec.structs.replace(msg, ticket=ticket))

    def _cancel_request(self, client: bytes, msg: wire.Cancel) -> None:
        self.held = [h for h in self.held if (h[0], h[1].id) != (client, msg.id)]
        self.contested = [c for c in self.contested if (c[0], c[1].id) != (client, msg.id)]
        ticket = self.tables.by_client.get((client, msg.id))
        if ticket is not None and not self.tables.requests[ticket].answered:
            self.tables.stats[ErrorCode.CANCELLED] += 1
            self.answers.cancel(self.tables.requests[ticket], ErrorCode.CANCELLED, "cancelled by the client")

    def snapshot(self, nonce: int = 0, tenant: str = "") -> wire.Stats:
        """The figures STATS answers; with ``tenant`` (a keyed client's), that tenant's alone of the tenants'."""
        running: Counter[str] = Counter(w.model for w in self.tables.workers.values() for _ in w.running)
        residency, ledger = self.tables.residency, self.tables.ledger
        now, swaps = time.monotonic(), {"single_active_swaps": residency.swaps} if residency else {}
        return wire.Stats(nonce, self.tables.accepting, {**self.tables.stats, **swaps}, {
            name: wire.ModelStats(len(mq.queue), running[name], mq.instances, len(mq.free), mq.failed,
                                  *self._chat(name, mq),
                                  self._oldest(mq, now),
                                  self.hooks.scaling(name), list(mq.adapters), mq.preempted,
                                  list(mq.adapters.values()), self._queued_adapters(mq))
            for name, mq in self.tables.models.items()
        }, [wire.WorkerStats(w.identity.decode(), w.model, w.host, w.pid, w.device, w.capacity, len(w.running))
            for w in self.tables.workers.values()],
            ledger.own_figures(tenant, self.tables.waiting) if tenant else ledger.figures(self.tables.waiting))

    def _chat(self, name: str, mq: ModelQueue) -> tuple[str, str, str]:
        """The chat template STATS hands out for ``name``: the one its instances told, else
        ``Tables.chat_before_load``."""
        chat = mq.chat or self.tables.chat_before_load(name)
        return chat.template, chat.bos_token, chat.eos_token

    def _oldest(self, mq: ModelQueue, now: float) -> float:
        """How long the oldest request queued for ``mq`` has waited (0 for none)."""
        return round(now - self.tables.requests[mq.queue.oldest()].accepted, 3) if mq.queue else 0.0

    def _queued_adapters(self, mq: ModelQueue) -> list[str]:
        """The adapters ``mq``'s queued requests ask for, each once, sorted (the picker's waiting_lora_adapters)."""
        return sorted({name for ticket in mq.queue for name, _ in self.tables.requests[ticket].request.adapters})

    def expire(self, now: float) -> None:
        """Cancel the requests of clients that stopped sending (closed, killed, or partitioned), and those of gone
        clients that no other took up in time (``Rebinder.expire``)."""
        self.rebinder.expire(now)
        silent = [c for c, heard in self.tables.heard.items() if now - heard > self.client_timeout]
        for client in silent:
            del self.tables.heard[client]
            self.tables.spoke.pop(client, None)
            self.tables.stats["client_expired"] += 1
            log.warning("client %s sent nothing for %.0f s; cancelling its requests", client.hex(),
                        self.client_timeout)
            self.answers.drop_client(client, f"cancelled: this client sent nothing for {self.client_timeout:g} s")

    def release_held(self) -> None:
        """The reattached requests held for the adoptees, taken again now that none is expected, each claimed as of
        when it came (``Rebinder.rebind``: whether the client that has it spoke since)."""
        held, self.held = self.held, []
        for client, req, tenant, admin, since in held:
            self._admit_again(client, req, tenant, admin, since)

    def retry_contested(self, now: float) -> None:
        """The contested claims asked again, at most each CONTEST_RETRY_S: taken up once the other client is found
        gone, run anew once it is heard from, contested on otherwise (``Rebinder.rebind``)."""
        if not self.contested or now < self._next_contest:
            return
        self._next_contest = now + CONTEST_RETRY_S
        contested, self.contested = self.contested, []
        for client, req, tenant, admin, since in contested:
            self._admit_again(client, req, tenant, admin, since)

    def _admit_again(self, client: bytes, req: wire.Request, tenant: str, admin: bool, since: float | None) -> None:
        """A held request admitted again; its refusal, if it is refused, sent as its ERROR."""
        try:
            self.admit(client, req, tenant, admin, since)
        except MpserveError as exc:
            self.answers.to_client(client, wire.encode(wire.Error(req.id, exc.code, exc.message, exc.retry_after)))
