"""LoRA adapters loaded and unloaded while the server runs: an operator's ADAPTER_ACTION, carried to every instance of
the model, answered once each has.

    ADAPTER_ACTION load (admin socket) ──▶ to each loaded instance of the model, a ticket each ──▶ every
        ADAPTER_REPLY in: the name joins the model's adapters (requests may name it; an instance that registers
        later is sent it too) ──▶ the operator gets the last ADAPTER_REPLY; the first ERROR otherwise (logged
        once, a WARNING)
    ADAPTER_ACTION unload ──▶ the name leaves the model's adapters at once (a new request naming it is
        unknown_adapter); the requests queued or running under it finish ──▶ then to each instance that has it
        ──▶ the operator's answer as for a load

An instance runs a request only with every adapter it names loaded (``WorkerEntry.adapters``, from its READY and its
replies): while a load is on its way, the instances that have it take those requests, and one that does not yet
waits for them. So no request fails for a load or an unload.

    a request for adapters no instance has, loads or will be sent (none starting: ``routing.stranded``) ──▶
        refused at admission (``Clients``), or, queued, when the last hope goes (a broker's load fails, an
        instance is lost, one registers that will not load them) ──▶ ERROR no_instance, naming the adapter and
        the call that loads it again
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

from mpserve.errors import BadRequest, MpserveError, NoInstance
from mpserve.wire import adapters as wire_adapters
from mpserve.wire import protocol as wire

from .dispatch import Dispatcher
from .routing import stranded
from .state import WorkerEntry
from .tables import Tables

log = logging.getLogger("mpserve.broker")


@dataclass
class Op:
    """One operator's call: who asked, what, and the instances still to answer."""

    client: bytes
    action: wire.AdapterAction
    model: str
    waiting: set[bytes] = field(default_factory=set)
    sent: bool = False  # an unload: sent once no request uses the adapter
    reply: wire.AdapterReply | None = None
    error: wire.Error | None = None


class AdapterOps:
    """The broker's adapter calls in flight (``ops``), by the ticket each instance answers under (``tickets``)."""

    def __init__(self, tables: Tables, dispatcher: Dispatcher) -> None:
        """``tables``: the models, workers and requests the calls concern; ``dispatcher``: where an instance that
        loaded an adapter may take requests for it, and the outboxes the calls and answers go through."""
        self.tables = tables
        self.dispatcher = dispatcher
        self.tickets: dict[str, tuple[Op | None, bytes, str]] = {}  # op (None: a load the broker sent a new
        # instance), the instance, the adapter's name
        self.draining: list[Op] = []  # unloads waiting for their adapter's requests to finish

    def start(self, client: bytes, msg: wire.AdapterAction) -> None:
        """An operator's call; BadRequest or UnknownAdapter when it cannot be done."""
        model = self.tables.resolve_model(msg.model)
        mq = self.tables.models[model]
        op = Op(client, msg, model)
        if msg.op == "load":
            if msg.name in mq.adapters:
                raise BadRequest(f"model {model!r} serves adapter {msg.name!r} already; unload it first to load "
                                 "another file under that name")
            targets = self.instances(model)
            if not targets:
                raise BadRequest(f"no instance of model {model!r} is loaded now; load the model first (mpserve load "
                                 f"{model}), then the adapter")
            self.send(op, targets)
            return
        refused = wire_adapters.unknown(((msg.name, 1.0),), mq.adapters, model)
        if refused is not None:
            raise refused
        mq.adapters.remove(msg.name)  # new requests are refused; those accepted finish first
        mq.adapter_paths.pop(msg.name, None)
        self.draining.append(op)
        self.drain()

    def instances(self, model: str, having: str | None = None) -> list[WorkerEntry]:
        """The model's instances that can take a call now (with the adapter ``having``, if given)."""
        return [w for w in self.tables.workers.values() if w.model == model and w.loaded and not w.unloading
                and (having is None or having in w.adapters)]

    def send(self, op: Op | None, targets: list[WorkerEntry], action: wire.AdapterAction | None = None) -> None:
        """The call to each of ``targets``, each under a ticket of its own."""
        action = action or (op.action if op is not None else None)
        assert action is not None
        for worker in targets:
            ticket = secrets.token_urlsafe(16)
            self.tickets[ticket] = (op, worker.identity, action.name)
            if op is not None:
                op.waiting.add(worker.identity)
            self.dispatcher.outbox.to_worker(worker.identity, wire.AdapterAction(
                action.id, action.op, action.name, action.model, action.path, ticket))

    def drain(self) -> None:
        """Send each unload whose adapter no request queued or running uses any more (called as requests end)."""
        for op in [op for op in self.draining if not self.in_use(op.model, op.action.name)]:
            self.draining.remove(op)
            op.sent = True
            targets = self.instances(op.model, having=op.action.name)
            if targets:
                self.send(op, targets)
            else:
                self.finish(op)

    def in_use(self, model: str, name: str) -> bool:
        return any(p.model == model and any(n == name for n, _ in p.request.adapters)
                   for p in self.tables.requests.values())

    def answered(self, identity: bytes, mtype: wire.MsgType, ticket: str, body: bytes) -> bool:
        """Whether the message answered an adapter call: its instance's adapters are updated, and the call is
        answered once every instance has."""
        found = self.tickets.get(ticket)
        if found is None or mtype not in (wire.MsgType.ADAPTER_REPLY, wire.MsgType.ERROR):
            return False
        op, worker, _ = found
        if worker != identity:
            return False
        del self.tickets[ticket]
        try:
            msg = wire.decode_body(mtype, body)
        except MpserveError as exc:
            msg = wire.Error(None, exc.code, exc.message)
        entry = self.tables.workers.get(identity)
        if isinstance(msg, wire.AdapterReply) and entry is not None:
            entry.adapters = frozenset(msg.adapters)
            self.dispatcher.dispatch(entry.model)  # it may take requests for that adapter now
        elif isinstance(msg, wire.Error) and op is None:  # a load the broker sent: the instance lacks the adapter
            log.error("instance %s: adapter call failed: %s", identity.decode(), msg.message)
            if entry is not None:
                self.refuse_stranded(entry.model)
        if op is not None:
            op.waiting.discard(identity)
            if isinstance(msg, wire.AdapterReply):
                op.reply = msg
            elif op.error is None:
                op.error = msg
            if not op.waiting:
                self.finish(op)
        return True

    def finish(self, op: Op) -> None:
        """Answer the operator: a load joins the model's adapters when every instance loaded it."""
        mq = self.tables.models[op.model]
        action = op.action
        if op.error is None and action.op == "load":
            mq.adapters.add(action.name)
            mq.adapter_paths[action.name] = action.path
        if op.error is not None:  # the operator is told; the log says it once, not once per instance
            log.warning("%s of adapter %r of model %r refused: %s", action.op, action.name, op.model, op.error.message)
            answer: wire.AdapterReply | wire.Error = wire.Error(action.id, op.error.code, op.error.message)
        else:
            answer = op.reply or wire.AdapterReply(action.id, "", action.op, action.name, tuple(mq.adapters))
        self.dispatcher.answers.to_client(op.client, wire.encode(answer))

    def registered(self, entry: WorkerEntry) -> None:
        """A new instance without some adapters loaded since the start: sent each."""
        mq = self.tables.models[entry.model]
        for name, path in mq.adapter_paths.items():
            if name not in entry.adapters and entry.loaded:
                self.send(None, [entry], wire.AdapterAction("broker", "load", name, entry.model, path))
        self.refuse_stranded(entry.model)  # one that will not have them (its model not loaded) runs none

    def lost(self, identity: bytes) -> None:
        """An instance that went away answers nothing more: the calls waiting for it go on without it."""
        for ticket, (op, worker, _) in list(self.tickets.items()):
            if worker == identity:
                del self.tickets[ticket]
                if op is not None:
                    op.waiting.discard(identity)
                    if not op.waiting:
                        self.finish(op)
        for model in self.tables.models:  # its requests are requeued next: those none of the others can run end
            self.refuse_stranded(model, identity)

    def refusal(self, model: str, adapters: wire_adapters.Selection) -> NoInstance | None:
        """Why a request for ``adapters`` of ``model`` can never start (``routing.stranded``): no instance has them
        loaded or is loading them, and none is starting; None while one has or may."""
        names = {name for name, _ in adapters}
        held = [w.adapters | {n for _, w_id, n in self.tickets.values() if w_id == w.identity}
                for w in self.tables.workers.values() if w.model == model and not w.draining]
        if not names or not stranded(names, held, self.dispatcher.hooks.loading(model)):
            return None
        missing = sorted(names - set().union(*held)) or sorted(names)
        which = ", ".join(repr(n) for n in missing)
        return NoInstance(f"no instance of model {model} has LoRA adapter {which} loaded: its load failed on each "
                          "instance, or those that had it are gone (the server log says why); load it again "
                          f"(mpserve adapters load {model} NAME FILE) or name adapters its instances have")

    def refuse_stranded(self, model: str, lost: bytes | None = None) -> None:
        """End the requests of ``model`` queued, or running on the instance ``lost`` (they would be requeued),
        that no instance can run (``refusal``): ERROR ``no_instance``, naming the adapter and what to do."""
        if not self.tables.models[model].adapters:
            return
        for p in [p for p in self.tables.requests.values() if p.model == model and p.request.adapters
                  and (p.worker is None or p.worker == lost)]:
            refused = None if p.answered else self.refusal(model, p.request.adapters)
            if refused is None:
                continue
            if p.worker is None:
                self.dispatcher.answers.unserved(p, refused.message)
            else:  # its worker's loss settles it as answered
                self.dispatcher.answers.answer_error(p, refused.code, refused.message)
