"""Speculative decoding: drafts by prompt lookup (taken from a sequence's own tokens) or by a draft model
(``mpserve.engine.draft``), verified in the sequence's next decode (``mpserve.engine.batch`` does the
decode; this module proposes by lookup, sizes and accepts).

    step, for each decoding sequence whose model speculates (``models[].speculative``):
      Drafter.propose(room)   type ngram: NgramIndex: the tokens that followed the latest earlier occurrence
                              of the sequence's last ngram_max .. ngram_min tokens (longest match first), in
                              its prompt and output; as many as pay for their rows (below), at most ``room``
      Drafter.size(room)      type draft: how many drafts pay for their rows and the draft model's decodes;
                              DraftModel.propose makes that many, greedily
      batch rows              next token, draft 1 .. draft k at the positions that follow, logits for each
      verify(drafts, sample)  sample row 0 with the sequence's own sampler chain; while the token drawn is
                              the next draft, sample the row after it: the tokens drawn, and how many
                              drafts they took
      engine                  the KV cells past the last taken draft are removed (llama_memory_seq_rm)
      Drafter.record(k, m)    acceptance so far, which sizes the next draft

Acceptance. A draft here is a deterministic proposal (q is one-hot on the draft token x: a lookup's token,
or a draft model's greedy choice, which depends only on tokens the sequence already has), for which the
standard rule that keeps the target distribution p (accept x with probability min(1, p(x)/q(x)) = p(x);
on rejection draw from max(0, p - q) renormalised, i.e. p with x removed) is the same law as: draw y from
p, take it, and go on only if y == x. ``verify`` draws with the sequence's sampler chain, so p is the
distribution of that chain (logit bias, penalties, grammar, top-k, top-p, min-p, temperature) at each
position, the chain sees exactly the tokens the sequence keeps, and it draws once per kept token, as it
does without speculation: with the same logits, a sequence (greedy, or sampled with a seed) gets the very
tokens it gets without speculation. The logits are the same while a decode holds at most ``exact_rows``
rows: with quantized weights llama.cpp's CPU matrix kernels give every row of a batch that small the very
numbers it gets alone (float weights do not: their rows of two or more go through llamafile's tinyBLAS, which
sums in another order than a lone row's dot product, so a float model's verified drafts are close, not equal,
to its tokens without speculation; ``reuse: exact`` decodes a float model's sequences one a decode), and larger
batches go through kernels whose sums differ from a lone row's, enough to change a greedy choice. How
small depends on the weights' layout: as stored, up to ``STORED_ROWS``; repacked for this CPU, ggml's
repacked matrix product computes batches of more than ``REPACKED_ROWS`` rows four rows at a time (gemm)
and smaller ones a row at a time (gemv), as it computes a lone row.
``exact: false`` lifts that bound (the batch's size is the only one): the drafts are verified the same way,
on logits of the same model computed by those other kernels.

Sizing. A draft of k tokens with per-token acceptance a is expected to add a + a^2 + ... + a^k tokens to
the step, and costs the rows it adds to the decode, plus, from a draft model, k decodes of the draft.
``RowCosts`` keeps the measured decode time per number of rows; ``Drafter`` drafts the k that gives the
most expected tokens per second of the whole step (0: do not speculate this step), with ``a`` estimated
from the sequence's recent drafts. Where drafts are seldom taken (free text) they are seldom made, so a
step without a useful draft costs what it costs without speculation. ``sizing: fixed`` skips the
estimate: n_max drafts whenever there are rows for them (llama-server's way).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from mpserve.config.speculative import Speculative

STORED_ROWS = 7
"""Most rows in a decode that holds drafts, weights as stored: the rows for which llama.cpp's CPU kernels
give each row what it gets alone (see the module docstring)."""

REPACKED_ROWS = 3
"""The same with weights repacked for this CPU (ggml-cpu's repack.cpp: ``nrows > 3`` takes the gemm)."""


def exact_rows(repack: bool) -> int:
    """Most rows in a decode that holds drafts, for weights loaded repacked (``repack``) or as stored."""
    return REPACKED_ROWS if repack else STORED_ROWS


CANDIDATES = 8
"""Earlier occurrences of the tail looked at for the longest match, most recent first."""

PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0
KEEP = 0.8
"""A sequence's acceptance estimate: taken drafts over verified ones, each past draft weighted KEEP^age,
plus PRIOR_WEIGHT draft tokens at PRIOR_ACCEPTANCE. Steps without a draft age the evidence too, so a
sequence that stopped drafting tries again after a while."""

ROW_COST_PRIOR = 0.1
"""Unmeasured row counts: each row adds this share of a one-row decode (optimistic, so it gets measured)."""
ROW_COST_KEEP = 0.9


class Verified(NamedTuple):
    tokens: list[int]  # drawn, in order: all kept, the last one not yet decoded
    taken: int  # drafts whose cells stay: the first ``taken`` drawn tokens are those drafts
    ended: str | None  # the finish reason if the sequence ended at the last token drawn


def verify(drafts: Sequence[int], sample: Callable[[int], tuple[int, str | None]]) -> Verified:
    """Draw from row 0 (the logits after the sequence's last token), then from row i + 1 for as long as the
    token drawn from row i is ``drafts[i]``. ``sample(row)``: the token drawn from that row with the
    sequence's chain, and a finish reason if the sequence ended with it."""
    tokens: list[int] = []
    for row in range(len(drafts) + 1):
        token, ended = sample(row)
        tokens.append(token)
        if ended is not None or row == len(drafts) or token != drafts[row]:
            return Verified(tokens, row, ended)
    raise AssertionError("unreachable: the last row always returns")


class NgramIndex:
    """Where each ``ngram_min``-token run of a sequence's tokens ends, appended to as the sequence grows."""

    __slots__ = ("tokens", "_n", "_ends")

    def __init__(self, ngram_min: int) -> None:
        self.tokens: list[int] = []
        self._n = ngram_min
        self._ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        n, ends, seq = self._n, self._ends, self.tokens
        for token in tokens:
            seq.append(token)
            if len(seq) >= n:
                ends.setdefault(tuple(seq[-n:]), []).append(len(seq) - 1)

    def propose(self, longest: int, k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the best earlier occurrence of the tail, and how many tail tokens
        matched there (at most ``longest``); ([], 0) when the last ``ngram_min`` tokens occurred only now."""
        seq, n = self.tokens, self._n
        if len(seq) < n or k < 1:
            return [], 0
        last = len(seq) - 1
        best_end, best_len = -1, 0
        for end in reversed(self._ends.get(tuple(seq[-n:]), [])[-CANDIDATES - 1:]):
            if end >= last:
                continue
            length = n
            while length < longest and end - length >= 0 and seq[end - length] == seq[last - length]:
                length += 1
            if length > best_len:
                best_end, best_len = end, length
        if best_end < 0:
            return [], 0
        return seq[best_end + 1:best_end + 1 + k], best_len


class RowCosts:
    """Decode seconds by the number of rows in the decode (exponential moving averages), one per engine."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        old = self._seconds.get(rows)
        self._seconds[rows] = seconds if old is None else ROW_COST_KEEP * old + (1 - ROW_COST_KEEP) * seconds

    def expected(self, rows: int) -> float:
        """Seconds a decode of ``rows`` rows takes, in units of a one-row decode where nothing is measured."""
        known = self._seconds.get(rows)
        if known is not None:
            return known
        base = self._seconds.get(1)
        if base is None:
            nearest = min(self._seconds, key=lambda r: abs(r - rows), default=None)
            base = 1.0 if nearest is None else self._seconds[nearest] / (1 + ROW_COST_PRIOR * (nearest - 1))
        return base * (1 + ROW_COST_PRIOR * (rows - 1))


class Drafter:
    """One sequence's drafts: its n-gram index (type ngram), its acceptance, and counts for its timings."""

    __slots__ = ("_setting", "_index", "_taken", "_tried", "proposed", "accepted")

    def __init__(self, setting: Speculative) -> None:
        self._setting = setting
        self._index = NgramIndex(setting.ngram_min)  # only type ngram adds to it
        self._taken = self._tried = 0.0
        self.proposed = self.accepted = 0

    @property
    def acceptance(self) -> float:
        return (self._taken + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (self._tried + PRIOR_WEIGHT)

    def propose(self, prompt: Sequence[int], generated: Sequence[int], room: int, rows: int,
                costs: RowCosts) -> list[int]:
        """Drafts to follow the sequence's tokens (``prompt``, then ``generated``: the last one is the token
        it decodes now); ``room``: the most rows the decode has left for them; ``rows``: the rows it holds
        without them."""
        seen = len(self._index.tokens)
        if seen < len(prompt):
            self._index.extend(prompt[seen:])
            seen = len(prompt)
        self._index.extend(generated[seen - len(prompt):])
        s = self._setting
        drafts, _ = self._index.propose(s.ngram_max, min(s.n_max, room))
        return drafts[:self.size(len(drafts), rows, costs)]

    def size(self, most: int, rows: int, costs: RowCosts, draft_s: float = 0.0) -> int:
        """How many drafts (at most ``most`` and n_max) to verify in a decode of ``rows`` rows without them;
        0 when fewer than n_min pay. ``draft_s``: what making each one costs besides its row (a draft
        model's decode), in the units of ``costs``."""
        s = self._setting
        most = min(most, s.n_max)
        k = most if s.sizing == "fixed" else _worth(most, self.acceptance, rows, costs, draft_s)
        if k < s.n_min:
            self._taken *= KEEP
            self._tried *= KEEP
            return 0
        return k

    def record(self, proposed: int, taken: int) -> None:
        self._taken = self._taken * KEEP + taken
        self._tried = self._tried * KEEP + taken + (1 if taken < proposed else 0)
        self.proposed += proposed
        self.accepted += taken


def _worth(most: int, acceptance: float, rows: int, costs: RowCosts, draft_s: float) -> int:
    """The number of drafts (0 .. most) that gives the most expected tokens per second to a decode of
    ``rows`` rows without them (each of those rows gives one token), each draft costing ``draft_s`` to make."""
    best_k, best_rate = 0, rows / costs.expected(rows)
    gain = 0.0
    for k in range(1, most + 1):
        gain += acceptance ** k
        rate = (rows + gain) / (costs.expected(rows + k) + k * draft_s)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k
