"""The broker's spans of a request (``mpserve.tracing``): one for each wait for a slot, recorded when the request is
given one, under the trace its REQUEST carried (the gateway's span; none: the span starts a trace of its own).

    accepted ─────────────────────────────────────────────┐ since ``Pending.accepted``: "queue"
    queued again (``requeued``): parked for a preemption ─┤ "preempted"
      its instance lost (a hand-over) ────────────────────┤ "hand-over"
      taken up from an adopted instance (a reattach) ─────┘ "reattach"
        ──▶ ASSIGN (``assigned``): the span recorded to now, with the routing's choice (worker, slot, attempt) ──▶
            the ASSIGN's request carries the span: the parent of the worker's prefill and decode

Only ``requeued`` runs while tracing is off (two assignments); ``assigned`` is called only while it is on.
"""

from __future__ import annotations

import time
from typing import Literal

import msgspec

from mpserve import tracing
from mpserve.wire import protocol as wire

from .state import Pending

Wait = Literal["preempted", "hand-over", "reattach"]


def requeued(p: Pending, why: Wait) -> None:
    """``p`` waits for a slot again, from now, because of ``why``."""
    p.waiting_since, p.waited_for = time.monotonic(), why


def assigned(tracer: tracing.Tracer, p: Pending, worker: str, slot: int) -> wire.Request:
    """Record ``p``'s wait, which ends now with its ASSIGN to ``slot`` of ``worker``; the request the ASSIGN carries,
    under that span."""
    since = p.waiting_since or p.accepted
    now = tracing.now_ns()
    start = now - int((time.monotonic() - since) * 1e9)
    request = p.request
    span = tracer.record(p.waited_for, tracing.valid(request.traceparent), start, now, {
        "mpserve.request_id": request.id, "mpserve.model": p.model, "mpserve.worker": worker, "mpserve.slot": slot,
        "mpserve.attempt": p.attempts, "mpserve.priority": p.priority, "mpserve.tenant": p.tenant,
        "mpserve.resumed_tokens": len(p.generated) // 4})
    return msgspec.structs.replace(request, traceparent=span)
