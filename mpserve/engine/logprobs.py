"""Log-probabilities of generated tokens, from a sequence's row of logits, as OpenAI reports them.

    after a decode: logits row (n_vocab floats, llama_get_logits_ith) + the sampled token
        ──add──▶ log-softmax of the raw logits (before any sampler: bias, penalties, top-k ... do not
                 change them), the sampled token's value and the top N, most probable first
        ──take──▶ protocol.Logprobs of the tokens added since the last take (a CHUNK's, or the DONE's)

    asked for the prompt's too (echo): before the first sampled token, each prompt token from the row of
    the token before it (``add`` with ``prompt=True``), or ``add_unscored`` for a first token nothing precedes

Vectorised over the vocabulary with numpy: one max, one exp-sum and one partial sort per token.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import numpy as np

from mpserve.wire import protocol as wire


class LogprobsRecorder:
    __slots__ = ("top", "_tokens", "_logprobs", "_top_tokens", "_top_logprobs", "_pieces", "_prompt")

    def __init__(self, top: int) -> None:
        self.top = top
        self._clear()

    def _clear(self) -> None:
        self._tokens: list[int] = []
        self._logprobs: list[float] = []
        self._top_tokens: list[np.ndarray] = []
        self._top_logprobs: list[np.ndarray] = []
        self._pieces: list[bytes] = []
        self._prompt = 0

    def add_unscored(self, token: int, piece: Callable[[int], bytes]) -> None:
        """A first prompt token, which no row scores: NaN, and top entries of id -1."""
        self._tokens.append(token)
        self._logprobs.append(math.nan)
        self._pieces.append(piece(token))
        if self.top:
            self._top_tokens.append(np.full(self.top, -1, np.int32))
            self._top_logprobs.append(np.full(self.top, math.nan))
            self._pieces += [b""] * self.top
        self._prompt += 1

    def add(self, logits: np.ndarray, token: int, piece: Callable[[int], bytes], prompt: bool = False) -> None:
        """``token`` was sampled from ``logits`` (float32, one per vocabulary entry), or, with ``prompt``, is the
        prompt token that follows the one whose row ``logits`` is."""
        peak = float(logits.max())
        log_total = peak + float(np.log(np.exp(logits - peak).sum(dtype=np.float64)))
        self._tokens.append(token)
        self._logprobs.append(float(logits[token]) - log_total)
        self._pieces.append(piece(token))
        if self.top:
            best = np.argpartition(logits, -self.top)[-self.top:]
            best = best[np.argsort(-logits[best], kind="stable")]
            self._top_tokens.append(best.astype(np.int32))
            self._top_logprobs.append(logits[best].astype(np.float64) - log_total)
            self._pieces += [piece(int(t)) for t in best]
        self._prompt += prompt

    def take(self) -> wire.Logprobs | None:
        """What was added since the last take; None if nothing was."""
        if not self._tokens:
            return None
        n = len(self._tokens)
        ends = np.cumsum([len(p) for p in self._pieces], dtype=np.int64)
        lp = wire.Logprobs(
            self.top, wire.pack_tokens(self._tokens), struct.pack(f"<{n}d", *self._logprobs),
            np.concatenate(self._top_tokens).astype("<i4").tobytes() if self.top else b"",
            np.concatenate(self._top_logprobs).astype("<f8").tobytes() if self.top else b"",
            b"".join(self._pieces), ends.astype("<i4").tobytes(), self._prompt)
        self._clear()
        return lp


def score_prompt(recorder: LogprobsRecorder | None, logits: Callable[[int], np.ndarray], prompt: list[int], pos: int,
                 n: int, piece_bytes: Callable[[int], bytes]) -> None:
    """Record the log-probability of each prompt token that follows a row of the chunk just decoded (its ``n`` tokens
    from position ``pos``; the last prompt token's row scores the first sampled token, as a generated one's)."""
    assert recorder is not None  # a sequence that scores its prompt records log-probabilities
    for i in range(min(n, len(prompt) - 1 - pos)):
        recorder.add(logits(i), prompt[pos + i + 1], piece_bytes, prompt=True)
