"""The broker's floor: the tables every manager above reads and changes, and the worker socket's outbox.

    Tables ─┬─ requests   ticket -> Pending (``mpserve.server.state`` draws a request's states); by_client:
            │             (client, request id) -> its first ticket; ids: (tenant, request id) -> its clients;
            │             deadlines: a heap of (when, ticket)
            ├─ workers    identity -> WorkerEntry (its running tickets, free slots in its model's queue)
            ├─ models     name -> ModelQueue (its fair queue, free slots, adapters, verdicts)
            ├─ lookups    TOKENIZE, EMBED, SLOT_ACTION ticket -> client, request id, worker
            ├─ clients    heard, spoke (last message, while a client has requests), owned, capped (pending counts)
            └─ journal    what a restart finds of the live requests (``mpserve.server.journal``)
    WorkerOutbox ─ ASSIGNs gathered per worker (``queue``) ─▶ one ASSIGNS at ``flush`` (or when a batch is
                   full) ─▶ back ROUTER; any other message to a worker goes after its gathered ASSIGNs
                   (``to_worker``: a CANCEL never passes its ASSIGN); a send that fails marks the worker
                   unreachable, and a lost ASSIGN's worker ``undelivered`` (the registry declares it lost)

The client side's outbox is ``mpserve.server.answers``: a client that cannot take a message loses its requests,
which is the answers' rule. Nothing here decides anything: the managers over it do (``mpserve.server.broker``
draws the floors).
"""

from __future__ import annotations

import heapq
import logging
import secrets
from collections import Counter

import zmq

from mpserve.counts import counted
from mpserve.errors import BadRequest, UnknownModel
from mpserve.wire import protocol as wire
from mpserve.wire import zmqio
from mpserve.wire.prefix import routed
from mpserve.wire.salt import reuse_salt

from . import roles
from .journal import Journal
from .residency import Residency
from .state import ModelQueue, Pending, WorkerEntry
from .tenants import FairQueue, Ledger

log = logging.getLogger("mpserve.broker")

DEFAULT_SERVICE_MS = 250.0
MAX_RETRY_AFTER_S = 30.0
ASSIGN_BATCH = 64  # ASSIGNs gathered for one worker before they go without waiting for the turn's end
TICKET_BYTES = 16


class Tables:
    """The broker's state: the three tables, the lookups, the clients' counts and the counters (``stats``)."""

    def __init__(self, models: dict[str, int], ledger: Ledger, residency: Residency | None,
                 embedding_models: frozenset[str], chat_templates: dict[str, str]) -> None:
        """``models``: name -> max queue length; the others as ``Broker`` takes them."""
        self.ledger = ledger
        self.residency = residency
        self.embedding_models = set(embedding_models)  # served ``embedding: true``: EMBED, no REQUEST
        self.chat_templates = chat_templates  # the template each model is served with (``mpserve.server.chat``)
        self.chat_eos: dict[str, str] = {}  # ... and the EOS text it needs before an instance tells its own
        self.models = {name: self.new_queue(name, max_queue) for name, max_queue in models.items()}
        self.requests: dict[str, Pending] = {}
        self.by_client: dict[tuple[bytes, str], str] = {}
        self.workers: dict[bytes, WorkerEntry] = {}
        self.lookups: dict[str, tuple[bytes, str, bytes]] = {}  # TOKENIZE ticket -> client, id, worker
        self.deadlines: list[tuple[float, str]] = []
        self.heard: dict[bytes, float] = {}  # clients with pending requests -> last message time (or when given one)
        self.spoke: dict[bytes, float] = {}  # ... -> when a message of theirs last came (``rebind``: alive since?)
        self.owned: dict[bytes, int] = {}  # clients -> number of pending requests
        self.capped: dict[bytes, int] = {}  # pending requests per client, or per tenant the gateway named
        self.detached: dict[bytes, float] = {}  # clients found gone -> when: their requests wait to be taken up
        self.ids: dict[tuple[str, str], set[bytes]] = {}  # (tenant, request id) -> the clients it is pending for
        self.kept_bytes = 0  # the chunk bodies the requests keep, in all (``mpserve.server.rebind``)
        self.journal = Journal()  # what a restart finds of the live requests (none until ``Broker.keep_journal``)
        self.stats: Counter[str] = Counter()
        self.accepting = True
        self.removed: set[str] = set()  # models a reload removed: new requests refused, the rest finish
        self.handing: set[bytes] = set()  # an upgrade: the instances told HAND_OFF that have not answered yet

    def serve_chat(self, model: str, template: str | None, eos: str | None) -> None:
        """``model`` is served with ``template`` (None: the server cannot tell), whose EOS text is ``eos``
        (``layout.eos_text``; None: not known)."""
        self.chat_templates.pop(model, None)
        self.chat_eos.pop(model, None)
        if template is not None:
            self.chat_templates[model] = template
            if eos is not None:
                self.chat_eos[model] = eos

    def chat_before_load(self, model: str) -> wire.ChatTemplate:
        """The chat template STATS hands out for ``model`` before any instance or pool told its own: the one it is
        served with, where the server knows all the gateways need to render it; else none."""
        if model not in self.chat_eos:
            return wire.ChatTemplate()
        return wire.ChatTemplate(self.chat_templates[model], "", self.chat_eos[model])

    def new_queue(self, name: str, max_queue: int) -> ModelQueue:
        """The queue of a model, its tenants weighted by their settings."""
        return ModelQueue(name, max_queue, FairQueue(self.ledger.weight))

    def registered(self, model: str) -> bool:
        """Whether an instance of ``model`` that takes requests is registered."""
        return any(w.model == model and not w.draining for w in self.workers.values())

    def bind(self, client: bytes, p: Pending) -> None:
        """The request ``p`` is the first row of is ``client``'s: by_client and ids."""
        self.by_client[(client, p.request.id)] = p.ticket
        self.ids.setdefault((p.tenant, p.request.id), set()).add(client)

    def unbind(self, client: bytes, p: Pending) -> None:
        """The request ``p`` is a row of is no longer ``client``'s."""
        self.by_client.pop((client, p.request.id), None)
        key = (p.tenant, p.request.id)
        clients = self.ids.get(key)
        if clients is not None:
            clients.discard(client)
            if not clients:
                del self.ids[key]

    def let_go(self, p: Pending) -> None:
        """``p`` keeps no text any more (it ended, or it ran out of room: ``mpserve.server.rebind``)."""
        self.kept_bytes -= p.kept_bytes
        p.kept, p.kept_bytes = None, 0

    def choices(self, p: Pending) -> list[Pending]:
        """The rows still here of the request ``p`` is a choice of (``p`` alone for a request for one)."""
        return [self.requests[t] for t in p.group if t in self.requests] if p.group else [p]

    def queued(self) -> int:
        return sum(len(mq.queue) for mq in self.models.values())

    def waiting(self, tenant: str) -> int:
        """``tenant``'s requests queued now, over every model."""
        return sum(mq.queue.waiting(tenant) for mq in self.models.values())

    def worker_at(self, index: int) -> WorkerEntry | None:
        """The registered local worker ``index``, if any."""
        return next((w for w in self.workers.values() if w.index == index), None)

    def add_deadline(self, p: Pending) -> None:
        """``p`` has a deadline: it joins the heap ``Broker.expire`` reads."""
        if p.deadline is not None:
            heapq.heappush(self.deadlines, (p.deadline, p.ticket))

    def stale_deadline(self, ticket: str) -> bool:
        p = self.requests.get(ticket)
        return p is None or p.answered

    def resolve_model(self, name: str | None) -> str:
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

    def too_many_choices(self, mq: ModelQueue, n: int) -> str | None:
        """Why ``n`` choices cannot run: no instance of the model (registered so far) has ``n`` slots."""
        most = max((w.capacity for w in self.workers.values() if w.model == mq.name), default=n)
        if n <= most:
            return None
        return (f"'n' = {n} is more than the {counted(most, 'slot')} of an instance of model {mq.name}: the choices "
                f"of a request run together in one instance; serve the model with 'parallel: {n}' (or --parallel {n}) "
                "or ask for fewer")

    def retry_after(self, mq: ModelQueue) -> float:
        """About when a place in the queue frees: one request's service time for each slot's worth of
        requests ahead, within 0.1..30 s."""
        per_request = (mq.service_ms or DEFAULT_SERVICE_MS) / 1000.0
        slots = max(1, mq.instances * max((w.capacity for w in self.workers.values() if w.model == mq.name),
                                          default=1))
        return round(min(MAX_RETRY_AFTER_S, max(0.1, per_request * len(mq.queue) / slots)), 2)


class WorkerOutbox:
    """What goes to the workers: the ASSIGNs gathered per worker, and every other message after them."""

    def __init__(self, back: zmq.Socket[bytes], tables: Tables, expiry: float) -> None:
        """``expiry``: how long a remote worker may be silent before it is lost (said when a send to it fails)."""
        self.back = back
        self.tables = tables
        self.expiry = expiry
        self.assigns: dict[bytes, list[bytes]] = {}  # worker -> packed ASSIGNs not sent yet (``flush``)
        self.undelivered: set[bytes] = set()  # remote workers an ASSIGN could not be sent to (``Registry.expire``)

    def queue(self, identity: bytes, body: bytes) -> None:
        """Gather a packed ASSIGN for ``identity``: sent at the next ``flush``, or now when the batch is full."""
        waiting = self.assigns.setdefault(identity, [])
        if waiting and sum(map(len, waiting)) + len(body) > wire.MAX_MESSAGE_BYTES:
            self.flush_to(identity)
            waiting = self.assigns.setdefault(identity, [])
        waiting.append(body)
        if len(waiting) >= ASSIGN_BATCH:
            self.flush_to(identity)

    def flush(self) -> None:
        """Send the ASSIGNs gathered since the last flush: to each worker, one message."""
        for identity in list(self.assigns):
            self.flush_to(identity)

    def flush_to(self, identity: bytes) -> None:
        """Send the ASSIGNs gathered for ``identity``, as one message."""
        bodies = self.assigns.pop(identity, None)
        if bodies and not self.send(identity, wire.encode_assigns(bodies)):
            self.undelivered.add(identity)

    def to_worker(self, identity: bytes, msg: object) -> None:
        """Send ``msg`` after the ASSIGNs still gathered for that worker (a CANCEL never passes its ASSIGN)."""
        self.flush_to(identity)
        self.send(identity, wire.encode(msg))

    def send(self, identity: bytes, frames: list[bytes]) -> bool:
        """Whether ``frames`` went to the worker's link (ZeroMQ queued them)."""
        try:
            zmqio.send(self.back, [identity, *frames], zmqio.NOBLOCK)
        except (zmq.Again, zmq.ZMQError) as exc:
            self._unreachable(identity, exc)
            return False
        return True

    def _unreachable(self, identity: bytes, exc: zmq.ZMQError) -> None:
        """A send to a worker failed: it died or its link is down. Said once until it is heard from again: a
        local worker's sentinel settles its requests, a remote one's silence (``Registry.expire``)."""
        entry = self.tables.workers.get(identity)
        if entry is None or entry.unreachable:
            return
        entry.unreachable = True
        if entry.index is not None:
            log.warning("cannot send to worker %s (%s); waiting for the supervisor to reap it", identity.decode(), exc)
        else:
            log.warning("cannot send to worker %s on %s (%s): its link is down; it is declared lost if it stays "
                        "silent for %.1f s, or at once if a request was not sent", identity.decode(), entry.host, exc,
                        self.expiry)


def cap_key(client: bytes, tenant: str) -> bytes:
    """Whose pending requests max_pending_per_client counts: a client's, but the gateway's (on the admin socket)
    per tenant it names, so that one of its callers cannot fill the gateway's share for all."""
    return b"\0tenant:" + tenant.encode() if tenant and roles.is_admin(client) else client


def new_ticket() -> str:
    """The name a request or lookup goes by between the broker and its worker: random, so that no other peer of the
    worker socket can guess it (a worker's answer counts only under a ticket the broker gave it)."""
    return secrets.token_urlsafe(TICKET_BYTES)


def request_salt(p: Pending) -> bytes:
    """``p``'s reuse namespace (``mpserve.wire.salt``), computed once: what routing matches its prompt under, and
    what its worker reuses cells under."""
    if p.salt is None:
        p.salt = reuse_salt(p.request.tenant, p.request.cache_salt, p.request.adapters)
    return p.salt


def routed_prompt(p: Pending) -> str:
    """``p``'s prompt as routing compares it with the instances' (``mpserve.wire.prefix.routed``: each image by its
    key), computed once."""
    if p.routed is None:
        p.routed = routed(p.request.prompt, p.request.images)
    return p.routed
