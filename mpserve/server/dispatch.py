"""Dispatch: which queued request starts on which free slot, and when a running one gives its slot up.

    a model's queue (fair: priority, then tenants' shares) ──head──▶ _batching_next (a younger request of that
        tenant and priority may go first, to batch with an instance's adapters) ──▶ _take_slots: the free slot
        ``routing.choose_slots`` picks among those whose instance has the request's adapters loaded (where it is
        parked: that instance only; n choices: n slots of one instance) ──▶ _assign: RUNNING, an ASSIGN gathered
        in the worker outbox
    single active backend ──▶ _dispatch_resident: each device's turn first (``residency``: UNLOAD what leaves),
        then the resident model's queue on that device's slots
    no free slot, requests waiting ──▶ _preempt_for: PREEMPT to the victims ``preemption.victims`` picks, then
        the waiting request's ASSIGN into each victim's slot ──▶ the worker's PARKED (``parked``): the victim
        queued again, parked on that worker, where it resumes
    drain(worker): no new request; STOP once it runs none · hand_over(worker): STOP now, its LEAVING hands its
        requests over (a roll) ──▶ hooks.worker_drained

Its decisions are pure functions elsewhere (``routing``, ``preemption``, ``residency``); this module carries them
out on the tables (``mpserve.server.tables``).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, deque

from mpserve import tracing
from mpserve.errors import ErrorCode
from mpserve.wire import protocol as wire
from mpserve.wire.prefix import PREFIX_BLOCK, block_hashes

from . import preemption, spans
from .answers import Answers
from .hooks import BrokerHooks
from .residency import Loaded
from .routing import MAX_HANDOVERS, QUEUE_WINDOW, choose_slots, pick_queued
from .state import ModelQueue, Pending, RequestState, WorkerEntry
from .tables import Tables, WorkerOutbox, request_salt, routed_prompt

log = logging.getLogger("mpserve.broker")


class Dispatcher:
    """Starts queued requests on free slots, preempts and parks, drains and hands over instances."""

    def __init__(self, tables: Tables, answers: Answers, outbox: WorkerOutbox, hooks: BrokerHooks) -> None:
        self.tables = tables
        self.answers = answers
        self.outbox = outbox
        self.hooks = hooks

    def dispatch(self, model: str) -> None:
        """Assign queued requests of ``model`` to its free slots, oldest request first."""
        if self.tables.residency is not None:
            self._dispatch_resident()
            return
        mq = self.tables.models[model]
        passed: set[str] = set()  # parked requests whose instance has no slot free: the requests behind pass them
        while mq.queue and mq.free:
            ticket = mq.queue.head(self.tables.ledger.eligible, passed)
            if ticket is None:  # every tenant waiting is at its max_running, or passed
                break
            p = self.tables.requests[ticket]
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
        assert self.tables.residency is not None
        for device in sorted({w.device for w in self.tables.workers.values()}):
            here = [w for w in self.tables.workers.values() if w.device == device]
            models = {w.model for w in here}
            waiting = sorted((m for m in models if self.tables.models[m].queue),
                             key=lambda m: self.tables.requests[self.tables.models[m].queue.oldest()].accepted)
            running = Counter(w.model for w in here for _ in w.running)
            loaded = [Loaded(w.identity, w.model, w.unloading) for w in here if w.loaded]
            for identity in self.tables.residency.decide(device, waiting, running, loaded):
                self.tables.workers[identity].unloading = True
                self.outbox.to_worker(identity, wire.Unload("another model takes the device"))
            for model in models:
                mq = self.tables.models[model]
                while mq.queue and self.tables.residency.allows(device, model):
                    ticket = mq.queue.head(self.tables.ledger.eligible)
                    if ticket is None:
                        break
                    p = self.tables.requests[ticket]
                    slots = self._take_slots(mq, p, device)
                    if slots is None:
                        if self._refuse_head(mq, p):
                            continue
                        break
                    mq.queue.pop(ticket)
                    for _ in slots:
                        self.tables.residency.started(device)
                    self._assign_choices(p, slots)

    def dispatch_freed(self, model: str, tenant: str) -> None:
        """A request of ``tenant`` left a slot of ``model``: dispatch that model, and the others where the tenant
        waits at its max_running (its running count is one for all models)."""
        self.dispatch(model)
        if self.tables.ledger.settings(tenant).max_running is not None:
            for name, mq in self.tables.models.items():
                if name != model and mq.queue.waiting(tenant):
                    self.dispatch(name)

    def dispatch_all(self) -> None:
        """Every model's queue looked at again (a reload changed the tenants' limits)."""
        for name in self.tables.models:
            self.dispatch(name)

    def _take_slots(self, mq: ModelQueue, p: Pending, device: int | None = None) -> list[tuple[bytes, int]] | None:
        """Take the free slot ``routing.choose_slot`` picks (on ``device``, if given), or for a request for n
        the n slots of one instance ``routing.choose_slots`` picks; count why (``routed_kv_prefix``, ...)."""
        names = {name for name, _ in p.request.adapters}
        free = [f for f in mq.free if names <= self.tables.workers[f[0]].adapters] if names else mq.free  # those loaded
        if p.parked_on is not None:  # where its sequence is held
            free = [f for f in free if f[0] == p.parked_on]
        route = choose_slots(free, self.tables.workers, routed_prompt(p), p.slots_needed, device, self._blocks(mq, p),
                             request_salt(p), p.request.adapters, self._adapter_sets(mq))
        if route is None:
            return None
        for slot in route.slots:
            mq.free.remove(slot)
        self.tables.stats[f"routed_{route.source.value}"] += 1
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
        window = [self.tables.requests[t] for t in itertools.islice(line, QUEUE_WINDOW)]
        chosen = window[pick_queued([(p.request.adapters, p.passed) for p in window], alone)]
        if chosen is not window[0]:
            window[0].passed += 1
        return chosen

    def _adapter_sets(self, mq: ModelQueue) -> dict[bytes, set[tuple[tuple[str, float], ...]]] | None:
        """The LoRA adapter sets each instance of the model runs requests of (``routing.affinity``); None for a
        model without adapters."""
        if not mq.adapters:
            return None
        return {w.identity: {self.tables.requests[t].request.adapters for t in w.running if t in self.tables.requests}
                for w in self.tables.workers.values() if w.model == mq.name}

    def _blocks(self, mq: ModelQueue, p: Pending) -> tuple[int, ...]:
        """``p``'s prompt's block hashes, for routing by what the instances' host stores hold: computed once per
        request, and only once some free instance holds anything in its cache."""
        if p.blocks is None:
            if len(routed_prompt(p)) < PREFIX_BLOCK or not any(self.tables.workers[w].ram for w, _ in mq.free):
                return ()
            p.blocks = block_hashes(routed_prompt(p), request_salt(p))
        return p.blocks

    def _refuse_head(self, mq: ModelQueue, p: Pending) -> bool:
        """A request for more choices than any instance now registered has slots (they came after it was
        accepted) would hold the queue up for ever: answer it. Whether it was."""
        refusal = self.tables.too_many_choices(mq, p.slots_needed)
        if refusal is not None:
            mq.queue.remove(p.ticket)
            self.answers.answer_error(p, ErrorCode.BAD_REQUEST, refusal)
        return refusal is not None

    def _assign_choices(self, p: Pending, slots: list[tuple[bytes, int]]) -> None:
        """Start ``p`` in ``slots[0]``; a request for n starts all its choices, one per slot (a choice retried
        after a worker died is queued on its own and needs one)."""
        choices = self.tables.choices(p) if p.slots_needed > 1 else [p]
        p.slots_needed = 1
        for choice, slot in zip(choices, slots, strict=True):
            self._assign(choice, slot)

    def _assign(self, p: Pending, slot: tuple[bytes, int]) -> None:
        identity, index = slot
        entry = self.tables.workers[identity]
        entry.parked.discard(p.ticket)  # parked there: the ASSIGN under its ticket resumes it
        p.parked_on = None
        p.preempting = False  # a PREEMPT that went to a worker lost meanwhile concerns this run no more
        p.attempts += 1
        p.state = RequestState.RUNNING
        p.worker = identity
        p.assigned = time.monotonic()
        self.tables.ledger.started(p.tenant, 0.0 if p.first_assigned else p.assigned - p.accepted)
        p.first_assigned = p.first_assigned or p.assigned
        entry.running[p.ticket] = index
        entry.prompts[index] = (request_salt(p), routed_prompt(p))
        entry.loaded = True  # an unloaded worker loads its model for the request
        log.debug("request %s of %s: started on worker %s, attempt %d", p.request.id, p.model, identity.decode(),
                  p.attempts)
        tracer = tracing.tracer()
        request = p.request if tracer is None else spans.assigned(tracer, p, identity.decode(), index)
        body = wire.pack(wire.Assign(p.ticket, request, (time.monotonic() - p.accepted) * 1000, p.attempts,
                                     slot=index, report_tokens=True, generated=bytes(p.generated), index=p.index,
                                     salt=request_salt(p)))
        self.outbox.queue(identity, body)

    # --- priority and preemption ---------------------------------------------------------------

    def _preempt_for(self, mq: ModelQueue) -> None:
        """Requests of ``mq`` wait and none of its slots is free: preempt the running requests
        ``preemption.victims`` picks. Each victim's worker gets PREEMPT, then the ASSIGN of the waiting request it
        gives way to, into its slot: the worker parks one and admits the other in the same turn."""
        if not mq.queue or mq.free or mq.failed is not None:
            return
        running, room = [], {}
        for entry in self.tables.workers.values():
            if entry.model != mq.name or entry.draining:
                continue
            room[entry.identity] = entry.capacity - len(entry.parked)
            for ticket in entry.running:
                p = self.tables.requests.get(ticket)
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
            p = self.tables.requests[ticket]
            if len(waiting) == len(running):
                break
            if p.parked_on is None and p.slots_needed == 1 and self.tables.ledger.may_start(p.tenant) and all(
                    {name for name, _ in p.request.adapters} <= self.tables.workers[w].adapters for w in room):
                waiting.append(p)  # (one whose adapters some instance has not loaded yet waits for a free slot)
        chosen = preemption.victims([p.priority for p in waiting], running, room)
        for p, ticket in zip(waiting, chosen, strict=False):
            victim = self.tables.requests[ticket]
            identity = victim.worker
            assert identity is not None
            victim.preempting = True
            log.debug("request %s of %s: preempted on worker %s for request %s", victim.request.id, mq.name,
                      identity.decode(), p.request.id)
            self.outbox.to_worker(identity, wire.Preempt(ticket))
            mq.queue.remove(p.ticket)
            self._assign(p, (identity, self.tables.workers[identity].running[ticket]))

    def parked(self, entry: WorkerEntry, p: Pending, tokens: bytes | None) -> None:
        """PARKED: ``entry`` holds ``p``'s sequence (its slot serves the request it gave way to); ``p`` is queued
        again at its priority, to resume there (a request cancelled meanwhile is forgotten there too)."""
        del entry.running[p.ticket]
        p.worker = None
        p.preempting = False
        mq = self.tables.models[entry.model]
        if p.answered or entry.draining:  # a draining worker's: it resumes elsewhere, from its tokens
            self.outbox.to_worker(entry.identity, wire.Cancel(p.ticket))
        if p.answered:  # cancelled or timed out while its PREEMPT went: it ran until now
            self.answers.left_slot(p)
            self.answers.finish(p)
            self.dispatch_freed(entry.model, p.tenant)
            return
        if tokens is not None and len(tokens) % 4 == 0:
            p.generated += tokens
        elif tokens is not None:
            p.tokens_known = False
        self.answers.left_slot(p)
        p.state = RequestState.QUEUED
        p.preemptions += 1
        if not entry.draining:
            p.parked_on = entry.identity
            entry.parked.add(p.ticket)
        self._count_preemption(mq, p)
        spans.requeued(p, "preempted")
        mq.queue.requeue(p.ticket, p.tenant, p.priority, p.cost)  # first of its priority, not charged again
        self.dispatch(entry.model)

    def _count_preemption(self, mq: ModelQueue, p: Pending) -> None:
        """Count ``p``'s preemption: in all, per model and per tenant."""
        self.tables.stats["preempted"] += 1
        mq.preempted += 1
        self.tables.ledger.preempted(p.tenant)
        log.debug("request %s of %s: parked (preempted %d time(s)), queued again", p.request.id, p.model,
                  p.preemptions)

    def unpin(self, entry: WorkerEntry) -> None:
        """``entry`` no longer holds the sequences parked on it (it was lost, or unloaded its model): those
        requests resume on any instance, from the tokens they streamed."""
        for ticket in entry.parked:
            p = self.tables.requests.get(ticket)
            if p is not None and p.parked_on == entry.identity:
                p.parked_on = None
        entry.parked.clear()

    # --- instances leaving ---------------------------------------------------------------------

    def drain(self, identity: bytes) -> None:
        """Scale down: the worker gets no new request; once it runs none it is told to STOP
        (``hooks.worker_drained``)."""
        entry = self.tables.workers[identity]
        entry.draining = True
        mq = self.tables.models[entry.model]
        mq.free = deque(f for f in mq.free if f[0] != identity)
        self.stop_if_drained(entry)
        self.dispatch(entry.model)
        self.outbox.flush()

    def hand_over(self, identity: bytes) -> bool:
        """A roll replaces the worker (``mpserve.server.rolling``): where each request it runs can go on elsewhere
        from the tokens it streamed (as after a worker's loss: ``routing.after_loss``), it is told to STOP now, and
        its LEAVING hands them over, first in line; else it drains as a scaled-down one does. Whether it hands
        them over."""
        entry = self.tables.workers[identity]
        running = [self.tables.requests[t] for t in entry.running if t in self.tables.requests]
        if any(p.handovers + 1 >= MAX_HANDOVERS or (p.state is RequestState.STREAMING and not
                                                    (p.generated and p.tokens_known)) for p in running):
            self.drain(identity)
            return False
        entry.draining = True
        mq = self.tables.models[entry.model]
        mq.free = deque(f for f in mq.free if f[0] != identity)
        self.outbox.to_worker(identity, wire.Stop("replaced by a roll"))
        self.hooks.worker_drained(entry)
        self.outbox.flush()
        return True

    def stop_if_drained(self, entry: WorkerEntry) -> None:
        if entry.draining and not entry.running:
            self.outbox.to_worker(entry.identity, wire.Stop("scaled down"))
            self.hooks.worker_drained(entry)
