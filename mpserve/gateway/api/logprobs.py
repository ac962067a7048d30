"""Log-probabilities in OpenAI's shapes: what a request asks for, and ``protocol.Logprobs`` as answered.

    /v1/completions        "logprobs": N  ->  {"tokens", "token_logprobs", "top_logprobs": [{token: lp}],
                                               "text_offset"}  (offsets in the prompt followed by the text)
                           with "echo": the prompt's tokens first, the first one's logprob and top null
    /v1/chat/completions   "logprobs": true, "top_logprobs": N  ->  {"content": [{"token", "logprob", "bytes",
                                               "top_logprobs": [{"token", "logprob", "bytes"}]}]}

N is 0..20 (``protocol.MAX_TOP_LOGPROBS``), checked by ``GenerateParams`` like every other parameter.
"""

from __future__ import annotations

from typing import Any

from mpserve.errors import BadRequest
from mpserve.wire import protocol as wire


def requested(chat: bool, given: dict[str, Any]) -> int | None:
    """The N of top log-probabilities a request asks for; None when it asks for none."""
    if not chat:
        return given.get("logprobs")  # an integer, checked with the other parameters
    asked, top = given.get("logprobs", False), given.get("top_logprobs")
    if not isinstance(asked, bool):
        raise BadRequest("'logprobs' must be a boolean")
    if top is not None and not asked:
        raise BadRequest("'top_logprobs' needs 'logprobs': true")
    return (0 if top is None else top) if asked else None


def completion(lp: wire.Logprobs, offset: int, null_first: bool = False) -> tuple[dict[str, Any], int]:
    """The completions shape, text offsets counted from ``offset``; returns it and the offset after it.
    ``null_first``: the first entry (an echoed prompt's first token) has a null logprob and top."""
    tokens: list[str] = []
    logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for _, piece, logprob, top in lp.entries():
        text = piece.decode("utf-8", "replace")
        tokens.append(text)
        logprobs.append(logprob)
        tops.append({t.decode("utf-8", "replace"): v for _, t, v in top})
        offsets.append(offset)
        offset += len(text)
    if null_first and tokens:
        logprobs[0] = tops[0] = None
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}, offset


def chat(lp: wire.Logprobs) -> dict[str, Any]:
    return {"content": [{"token": piece.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(piece),
                         "top_logprobs": [{"token": t.decode("utf-8", "replace"), "logprob": v, "bytes": list(t)}
                                          for _, t, v in top]}
                        for _, piece, logprob, top in lp.entries()], "refusal": None}
