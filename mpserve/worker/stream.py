"""One request's text on its way out: streamed as CHUNK messages, with its token ids, then its answer.

    engine on_token --push(piece)--> ChunkStream --send(text)--> CHUNK to the broker
                    --note()-------> Noted ──take()──▶ the CHUNK's token ids (``report_tokens``)
    engine step ──Completion──answer(assign, result, worker)──▶ DONE or ERROR

The first piece goes at once; later pieces are gathered and sent together once ``interval`` seconds have
passed since the last send; ``flush`` sends what is left (just before DONE). Every message costs CPU in
three processes (worker, broker, client) on cores that llama.cpp's threads are using; gathering the pieces
a few steps produce keeps that cost from growing with the token rate (0 sends every piece on its own). The
concatenated chunks are always the whole text.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from mpserve.engine.interface import Completion
from mpserve.errors import ErrorCode
from mpserve.wire import protocol as wire


class ChunkStream:
    __slots__ = ("_send", "_interval", "_parts", "_sent_at")

    def __init__(self, send: Callable[[str], None], interval: float) -> None:
        self._send = send
        self._interval = interval
        self._parts: list[str] = []
        self._sent_at = -interval  # the first piece goes at once

    def push(self, text: str) -> None:
        self._parts.append(text)
        now = time.monotonic()
        if now - self._sent_at >= self._interval:
            self._sent_at = now
            self.flush()

    def flush(self) -> None:
        if self._parts:
            text = "".join(self._parts)
            self._parts.clear()
            self._send(text)


def answer(assign: wire.Assign, result: Completion, worker: str) -> wire.Done | wire.Error:
    """What the broker is told of the request ``assign`` carried, ended with ``result`` on ``worker``."""
    req = assign.request
    if result.finish_reason == "cancelled":
        return wire.Error(req.id, ErrorCode.CANCELLED, "cancelled")
    if result.error is not None:
        return wire.Error(req.id, result.error.code, result.error.message)
    usage = wire.Usage(result.prompt_tokens, result.completion_tokens, result.reasoning_tokens)
    return wire.Done(
        req.id, result.text, result.finish_reason, usage,
        wire.Timings(assign.queue_ms, result.prompt_s * 1000, result.generate_s * 1000, assign.attempt,
                     cached_tokens=result.reused_tokens, draft_tokens=result.draft_tokens,
                     accepted_tokens=result.accepted_tokens),
        worker=worker, logprobs=result.logprobs, index=assign.index,
    )


class Noted:
    """The ids of the tokens a streamed request's sequence gave since its last CHUNK (``Assign.report_tokens``):
    noted as each token comes (``seen``: how many of the sequence's tokens were), taken by the next CHUNK, or by
    PARKED when the sequence is parked with their text held back."""

    __slots__ = ("_tokens", "seen", "_ids")

    def __init__(self, tokens: Callable[[], Sequence[int]]) -> None:
        self._tokens = tokens
        self.seen = 0
        self._ids: list[int] = []

    def note(self) -> None:
        new = self._tokens()[self.seen:]
        self.seen += len(new)
        self._ids.extend(new)

    def take(self) -> list[int]:
        ids, self._ids = self._ids, []
        return ids
