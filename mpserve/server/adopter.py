"""Adoption as the broker sees it: the instances of the server that died before this one register with the requests
they hold, and their clients reattach (``mpserve.server.adoption`` draws the whole hand-over between starts).

    expect(indexes, secrets, wait) ─▶ those instances may prove themselves with the dead server's secrets
    an adoptee's READY with LIVE ─▶ adopt: a HEARTBEAT tells it it was adopted; each live request is held, parked on
                                   it, for its client (``Adoptions``), with the text it streamed so far; so is each
                                   answer it sent just before the death that the journal has not ended (an ASSIGN
                                   of it is answered at once), the others forgotten there
    the dead server's journal (``journal.read``) ─▶ journaled: each row held likewise, parked nowhere
    a client's REQUEST with reattach ─▶ reattach: the rows held for that tenant and id become requests again, its
                                   text so far streamed first, queued first in line where they are parked (a
                                   journaled one, once no adoptee is expected: resumed from its tokens anywhere)
    held past ``adoption.HOLD_S`` ─▶ expire: forgotten on their instance (CANCEL)

While adoptees are still expected, a reattached request nobody holds yet waits (``Clients.held``), and runs anew
once none is.
"""

from __future__ import annotations

import logging
import os
import time

import msgspec

from mpserve.wire import protocol as wire

from . import adoption, link, rebind, spans
from .answers import Answers
from .dispatch import Dispatcher
from .state import Pending, RequestState, WorkerEntry
from .tables import Tables, WorkerOutbox, cap_key, new_ticket

log = logging.getLogger("mpserve.broker")


class Adopter:
    """The secrets local workers may prove themselves with, and the adopted instances' requests."""

    def __init__(self, tables: Tables, dispatcher: Dispatcher) -> None:
        """``dispatcher``: where a reattached request is queued, and the outboxes its text and CANCELs go through."""
        self.tables = tables
        self.dispatcher = dispatcher
        self.answers: Answers = dispatcher.answers
        self.outbox: WorkerOutbox = dispatcher.outbox
        self.link_secret = link.new_secret()  # the proof of the workers the server starts (``Supervisor``)
        self.adopted_secrets: tuple[str, ...] = ()  # those of the instances it adopts
        self.adoptions = adoption.Adoptions()
        self.journal_ids: set[tuple[str, str]] | None = None  # the requests (tenant, id) the journal of the server
        # before this one had live (None: it left none: ``journaled``)

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

    def adopt(self, entry: WorkerEntry, live: tuple[wire.Live, ...]) -> bool:
        """An adoptee registered with the requests it holds, parked, and the answers it sent just before the death:
        each waits for its client to reattach (an answer the dead server's journal had ended, its client got: it is
        forgotten there). It hears at once that it was adopted (a HEARTBEAT with this server's pid: it moves its rows
        into this start's slot table, where the next start would look for it). Whether it was the last adoptee
        expected."""
        self.adoptions.expected.discard(entry.identity)
        self.outbox.to_worker(entry.identity, wire.Heartbeat(entry.identity.decode(), pid=os.getpid()))
        now = time.monotonic()
        held = {False: 0, True: 0}  # requests, answers
        for one in live:
            assign, req = one.assign, one.assign.request
            p = Pending(assign.ticket, b"", req, entry.model, now, None, attempts=assign.attempt,
                        generated=bytearray(one.generated), tokens_known=assign.report_tokens, index=assign.index,
                        tenant=req.tenant, priority=req.priority, first_assigned=now,
                        first_token=now if one.text else 0.0, parked_on=entry.identity,
                        state=RequestState.STREAMING if one.text else RequestState.QUEUED)
            for row in self.adoptions.journaled(p.tenant, req.id):  # this instance holds it: better
                self._forget(row)
            if one.answered and self.journal_ids is not None and (p.tenant, req.id) not in self.journal_ids:
                self.outbox.to_worker(entry.identity, wire.Cancel(p.ticket))
                continue
            entry.parked.add(p.ticket)
            self._hold(p, one.text, now)
            held[one.answered] += 1
        self.tables.stats["adopted_requests"] += held[False]
        self.tables.stats["adopted_answers"] += held[True]
        log.info("adopted worker %s (pid %d) of the server before this one, holding %d request(s) and %d answer(s) "
                 "for their clients", entry.identity.decode(), entry.pid, held[False], held[True])
        return not self.adoptions.expected

    def journaled(self, rows: list[tuple[Pending, str]], found: bool) -> None:
        """The rows the journal of the server before this one had (``journal.read``; ``found``: whether it left one):
        held for their clients, taken once no adoptee is expected (one may bring the same, parked)."""
        self.journal_ids = {(p.tenant, p.request.id) for p, _ in rows} if found else None
        now = time.monotonic()
        held = [(p, text) for p, text in rows if p.model in self.tables.models]
        for p, text in held:
            p.ticket = new_ticket()  # its instance may live on, holding it parked under the old one, further on
            self._hold(p, text, now)
        self.tables.stats["journaled_requests"] += len(held)
        if held:
            log.info("the journal of the server before this one holds %d request(s) for their clients", len(held))

    def _hold(self, p: Pending, text: str, now: float) -> None:
        """``p`` held for its client, its text kept (another client may take it up) and journaled."""
        if text:
            rebind.keep(self.tables, p, wire.pack(wire.Chunk(p.request.id, text, None, p.index)))
        self.tables.journal.whole(p)
        self.adoptions.hold(p, text, now)

    def reattach(self, client: bytes, req: wire.Request, tenant: str) -> bool:
        """A client sent ``req`` again after the server before this one died: if an adoptee holds it (every choice),
        it goes on there, its whole text so far streamed first; if the journal had it (once no adoptee is expected),
        it resumes from its tokens, likewise. False: this broker does not hold it (run it anew)."""
        rows = self.adoptions.take(tenant, req.id, journaled=not self.adoptions.expecting(time.monotonic()))
        if len(rows) != req.params.n or (req.model is not None
                                         and self.tables.resolve_model(req.model) != rows[0][0].model):
            for p, _ in rows:
                self._forget(p)
            return False
        now = time.monotonic()
        rows.sort(key=lambda row: row[0].index)
        tickets = tuple(p.ticket for p, _ in rows)
        mq = self.tables.models[rows[0][0].model]
        for p, text in rows:
            p.client, p.request = client, msgspec.structs.replace(p.request, timeout=req.timeout)
            p.group = tickets if len(tickets) > 1 else ()
            p.deadline = now + req.timeout if req.timeout else None
            if p.parked_on not in self.tables.workers:  # its instance was lost meanwhile: it resumes from its tokens
                p.parked_on = None
            self.tables.requests[p.ticket] = p
            self.tables.add_deadline(p)
            if req.stream and text:
                self.answers.to_client(client, wire.encode(wire.Chunk(req.id, text, None, p.index)))
            spans.requeued(p, "reattach")
            mq.queue.requeue(p.ticket, tenant, p.priority, p.cost)
        self.tables.bind(client, rows[0][0])
        self.tables.owned[client] = self.tables.owned.get(client, 0) + len(rows)
        capped = cap_key(client, tenant)
        self.tables.capped[capped] = self.tables.capped.get(capped, 0) + len(rows)
        self.tables.heard.setdefault(client, now)
        self.tables.stats["reattached"] += 1
        log.debug("request %s of %s: reattached to its adopted sequence(s)", req.id, mq.name)
        self.dispatcher.dispatch(mq.name)
        return True

    def _forget(self, p: Pending) -> None:
        """An adopted or journaled request no client took: its instance forgets it, and the journal."""
        self.tables.let_go(p)
        self.tables.journal.end(p)
        entry = self.tables.workers.get(p.parked_on) if p.parked_on is not None else None
        if entry is not None:
            entry.parked.discard(p.ticket)
            self.outbox.to_worker(entry.identity, wire.Cancel(p.ticket))

    def expire(self, now: float) -> None:
        """Forget the adopted requests no client reattached to in time."""
        for p in self.adoptions.expired(now):
            self.tables.stats["adopted_unclaimed"] += 1
            self._forget(p)

    def lost(self, index: int) -> None:
        """Adoptee ``index`` exited, or was killed for not registering in time: it brings nothing."""
        self.adoptions.expected.discard(f"w{index}".encode())
