"""A worker's results: its requests' CHUNKs, DONEs, ERRORs and PARKEDs, alone or in one STEP, forwarded to their
clients unchanged, looked up by ticket.

    STEP (one worker step) ─▶ step: entry by entry, in order; per client, the step's CHUNK bodies spliced into
                              one CHUNKS (one: a CHUNK), sent before that client's next DONE or ERROR
    CHUNK ─▶ _streaming: STREAMING, its token ids kept (``Pending.generated``: a hand-over resumes from them), its
             body kept (``rebind.keep``: another client may take it up), both journaled (``journal``: a restart
             resumes it from them)
    DONE / ERROR ─▶ result: to the client (a DONE after a hand-over with the whole request's timings), the slot
                    freed (or the drained worker told to STOP), the tenant charged ─▶ the dispatcher
    PARKED ─▶ ``Dispatcher.parked``
    an answer that is malformed or names another request ─▶ _foreign: the request ends ``internal``

A result under a ticket its worker does not run (the request ended, or went to another worker) is dropped and
counted (``dropped_stale_result``). The CACHE frame a DONE or ERROR carries updates what that worker's host store
holds, for routing (``cache_changed``).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import msgspec

from mpserve.errors import ErrorCode, MpserveError
from mpserve.wire import protocol as wire

from . import link, rebind
from .answers import Answers
from .dispatch import Dispatcher
from .state import Pending, RequestState, WorkerEntry
from .tables import Tables

log = logging.getLogger("mpserve.broker")

CHUNK_FRAME = wire.TYPE_FRAMES[wire.MsgType.CHUNK]
CHUNKS_FRAME = wire.TYPE_FRAMES[wire.MsgType.CHUNKS]


class Results:
    """The results of the requests running on the workers, to their clients."""

    def __init__(self, tables: Tables, dispatcher: Dispatcher) -> None:
        self.tables = tables
        self.dispatcher = dispatcher
        self.answers: Answers = dispatcher.answers

    def step(self, identity: bytes, batch: bytes) -> None:
        """A worker's STEP, entry by entry in order: each client gets the step's chunks meant for it as one
        message, before its next DONE or ERROR."""
        try:
            entries = wire.step_entries(batch)
        except MpserveError as exc:
            self.tables.stats["dropped_worker_malformed"] += 1
            log.error("dropped a bad STEP from worker %r: %s", identity, exc)
            return
        entry = self.tables.workers.get(identity)
        by_client: dict[bytes, list[bytes]] = {}
        for mtype, ticket, body, trailer in entries:
            if mtype is wire.MsgType.CHUNK:
                p = self._running_on(entry, ticket)
                if p is not None and not self._foreign(p, mtype, body) and self._streaming(p, trailer):
                    by_client.setdefault(p.client, []).append(body)
                    self._kept(p, body, trailer)
                continue
            p = self.tables.requests.get(ticket)
            if p is not None and p.client in by_client:
                self._send_chunks(p.client, by_client.pop(p.client))
            self.result(identity, mtype, ticket, wire.TYPE_FRAMES[mtype], body, trailer)
        for client, bodies in by_client.items():
            self._send_chunks(client, bodies)

    def _send_chunks(self, client: bytes, bodies: list[bytes]) -> None:
        if len(bodies) == 1:
            self.answers.to_client(client, [wire.VERSION, CHUNK_FRAME, bodies[0]])
        else:
            self.answers.to_client(client, [wire.VERSION, CHUNKS_FRAME, wire.splice_array(bodies)])

    def result(self, identity: bytes, mtype: wire.MsgType, ticket: str, type_frame: bytes, body: bytes,
               trailer: bytes | None) -> None:
        """One result of request ``ticket`` from worker ``identity`` (``trailer``: its fifth frame, if any)."""
        entry = self.tables.workers.get(identity)
        if trailer is not None and entry is not None and mtype not in (wire.MsgType.CHUNK, wire.MsgType.PARKED):
            self.cache_changed(entry, trailer)  # whether or not the request is still there
        p = self._running_on(entry, ticket)
        if p is None or entry is None:
            return
        if self._foreign(p, mtype, body):
            if mtype is wire.MsgType.CHUNK:
                return
            mtype, type_frame, body = wire.MsgType.ERROR, b"", b""  # answered already: only the slot is freed
        if mtype is wire.MsgType.CHUNK:
            if self._streaming(p, trailer):
                self.answers.to_client(p.client, [wire.VERSION, type_frame, body])
                self._kept(p, body, trailer)
            return
        if mtype is wire.MsgType.PARKED:
            self.dispatcher.parked(entry, p, trailer)
            return
        slot = entry.running.pop(ticket)
        self.answers.left_slot(p)
        mq = self.tables.models[entry.model]
        if mtype is wire.MsgType.DONE:  # the engine works: its model's crash streak starts afresh
            mq.crash_streak = 0
            mq.crashed.clear()
            self.answers.used(p, body)
        if not p.answered:
            p.state = RequestState.ANSWERED
            self.tables.stats["done" if mtype is wire.MsgType.DONE else "worker_error"] += 1
            if mtype is wire.MsgType.DONE and p.attempts > 1:
                body = timed_whole(p, body)
            self.answers.to_client(p.client, [wire.VERSION, type_frame, body])
            if mtype is wire.MsgType.ERROR:
                self.answers.end_other_choices(p, ErrorCode.CANCELLED, "another choice of the request failed")
        service_ms = (time.monotonic() - p.assigned) * 1000
        mq.service_ms = service_ms if not mq.service_ms else 0.9 * mq.service_ms + 0.1 * service_ms
        self.answers.finish(p)
        if entry.draining:
            self.dispatcher.stop_if_drained(entry)
        elif not p.preempting:  # a request that ended before its PREEMPT came: its slot is given already
            mq.free.append((identity, slot))
        self.dispatcher.dispatch_freed(entry.model, p.tenant)

    def _kept(self, p: Pending, body: bytes, tokens: bytes | None) -> None:
        """A CHUNK of ``p`` forwarded: kept for another client (``rebind.keep``), and journaled for a restart (its
        row lost to it once its text or its tokens are)."""
        rebind.keep(self.tables, p, body)
        self.tables.journal.chunk(p, tokens if p.kept is not None and p.tokens_known else None, body)

    def _running_on(self, entry: WorkerEntry | None, ticket: str) -> Pending | None:
        """The request ``ticket`` if ``entry`` runs it; else None, counted as a stale result (the request
        ended, or was handed to another worker)."""
        p = self.tables.requests.get(ticket)
        if p is None or entry is None or ticket not in entry.running:
            self.tables.stats["dropped_stale_result"] += 1
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
        self.tables.stats["worker_malformed_result"] += 1
        log.error("worker %r sent %s for request %s; ending it", p.worker, why, p.request.id)
        message = f"the instance running this request sent {why}; see the server log"
        if mtype is wire.MsgType.CHUNK:
            self.answers.cancel(p, ErrorCode.INTERNAL, message)
        else:
            self.answers.answer_error(p, ErrorCode.INTERNAL, message)
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

    def cache_changed(self, entry: WorkerEntry, frame: bytes) -> None:
        """A CACHE frame: what the worker's host store gained and lost, for routing."""
        try:
            entry.ram.apply(wire.frame_cache(frame))
        except MpserveError as exc:
            self.tables.stats["dropped_worker_malformed"] += 1
            log.error("dropped a bad CACHE frame from worker %r: %s", entry.identity, exc)


def timed_whole(p: Pending, body: bytes) -> bytes:
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
