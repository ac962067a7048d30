"""A worker's spans of each request it runs (``mpserve.tracing``), children of the broker's span in its ASSIGN; made
only while tracing is on (``for_worker`` gives None otherwise, and the worker skips every call).

    ASSIGN (request.traceparent: the broker's "queue" span) ──accepted──▶ the time it was admitted, by ticket
    the completion (its prompt and generation times) ──answered──▶ "prefill" (admitted → its first token; the
        tokens reused from cells or the host store in its attributes) and "decode" (→ its end), recorded whole
"""

from __future__ import annotations

from mpserve import tracing
from mpserve.engine.interface import Completion
from mpserve.wire import protocol as wire


class RequestSpans:
    def __init__(self, tracer: tracing.Tracer, worker: str) -> None:
        self._tracer = tracer
        self._worker = worker
        self._admitted: dict[str, int] = {}  # ticket -> when (ns) its request was admitted here

    def accepted(self, assign: wire.Assign) -> None:
        if tracing.valid(assign.request.traceparent):
            self._admitted.setdefault(assign.ticket, tracing.now_ns())

    def answered(self, assign: wire.Assign, result: Completion) -> None:
        """Record the request's prefill and decode, from its admission and the engine's times (nothing for a request
        that came without a trace context, or was parked and resumed: its first admission's time is kept)."""
        admitted = self._admitted.pop(assign.ticket, None)
        if admitted is None:
            return
        parent = assign.request.traceparent
        first = admitted + int(result.prompt_s * 1e9)
        common = {"mpserve.request_id": assign.request.id, "mpserve.worker": self._worker,
                  "mpserve.attempt": assign.attempt}
        self._tracer.record("prefill", parent, admitted, first, {
            **common, "mpserve.prompt_tokens": result.prompt_tokens, "mpserve.cached_tokens": result.reused_tokens})
        self._tracer.record("decode", parent, first, first + int(result.generate_s * 1e9), {
            **common, "mpserve.completion_tokens": result.completion_tokens,
            "mpserve.reasoning_tokens": result.reasoning_tokens, "mpserve.finish_reason": result.finish_reason})

    def dropped(self, ticket: str) -> None:
        """Forget a request that ended without a completion (cancelled before its end, an error at admission)."""
        self._admitted.pop(ticket, None)


def for_worker(worker: str) -> RequestSpans | None:
    tracer = tracing.configure("worker")
    return None if tracer is None else RequestSpans(tracer, worker)
