"""Carried tokens: those an instance that was lost had generated for a request, taken in place of sampling by the
instance that goes on with it (``BatchEngine.admit``'s ``carried``).

    admit ──carried──▶ Sequence.replay: decoded after the prompt, each taken as if sampled
          ──live cells restored (``live``, ``reuse: exact``)──▶ restored: those the cells hold taken at once
    step  ──Scheduler.runs──▶ Sequence.ahead: carried tokens decoded in the same llama_decode as the sequence's next
                              token, at the positions after it (``reuse: any`` only)
          decode
          ──take(seq)──▶ the ``ahead`` tokens, then one more: their text into the completion (not to ``on_token``:
                          the client has it), the sampler told of them (its penalties, a grammar's state, thinking's
                          phases), ``generated``; the last one taken is the next step's token to decode

With ``reuse: exact`` a carried token is decoded one a step, as it was first computed: a run of them in one
llama_decode is a batched prefill, which orders attention's and the matrix products' sums otherwise, and that can
turn a greedy choice at a near-tie; that mode promises the text of an uninterrupted run. With ``reuse: any`` a
resumed request computes its carried tokens at a prompt's pace (a run of them a step), so its stream goes on within a
few steps rather than after as many steps as it had tokens; what follows them may differ from the uninterrupted run
where a near-tie turns, as it may where a prompt starts from reused cells. Either way nothing reaches the client twice
and nothing is missing: the text held back at the cut stays held back.
"""

from __future__ import annotations

import collections.abc
from typing import TYPE_CHECKING

from .sequence import Phase, Sequence

if TYPE_CHECKING:
    from .context import Context


def take(seq: Sequence, context: Context) -> str | None:
    """Take the carried tokens this decode computed ahead (``seq.ahead``), then the next one; the finish reason if
    the sequence ended. Where it ends before the last of those ahead (a cancel), the cells past its last decoded
    token are removed, as if it had decoded one a step."""
    ahead, seq.ahead = seq.ahead, 0
    for taken in range(ahead + 1):
        ended = _take_one(seq, context)
        if ended is not None:
            if taken < ahead:
                seq.n_past -= ahead - taken
                if not context.seq_rm(seq.slot, seq.n_past, -1):  # a recurrent state cannot be cut: drop it all
                    context.seq_rm(seq.slot, -1, -1)
                    seq.n_past = 0
            return ended
    return None


def restorable(carried: collections.abc.Sequence[int], stops: collections.abc.Sequence[str], max_tokens: int,
               context: Context) -> collections.abc.Sequence[int]:
    """Of a resumed request's ``carried`` tokens, those whose cells a live entry may give it (``live``): all but the
    last, which ``restored`` takes with them, unless it may have ended the sequence (an end of generation, the last
    of ``max_tokens``, or any where stop strings are set): then all but the last two, and the last is taken after
    the first decode, as one a step takes it."""
    if not carried:
        return ()
    may_end = bool(stops) or len(carried) >= max_tokens or context.piece(carried[-1])[1]
    return carried[:-2] if may_end else carried[:-1]


def restored(seq: Sequence, context: Context, cells: int) -> None:
    """``seq`` starts from ``cells`` restored cells (``live``): its prompt's and its first carried tokens'. Those tokens
    are taken as the steps that computed them took them, and so is the one after them, the next to decode (it has no
    cell yet). None of them ends the sequence: the lost instance went on past each, and the last carried token is
    among them only where it cannot have ended it (``restorable``)."""
    for _ in range(cells - len(seq.prompt) + 1):
        token = seq.replay.popleft()
        text, _ = _accept(seq, token, context.piece(token)[0])
        seq.pieces.append(text)
    seq.n_past, seq.phase, seq.next_token = cells, Phase.DECODE, seq.generated[-1]


def _take_one(seq: Sequence, context: Context) -> str | None:
    """Take the next carried token as if sampled; its text goes into the completion only. The finish reason if the
    lost instance had ended there (it died between its last text and its answer)."""
    token = seq.replay.popleft()
    piece, end_of_generation = context.piece(token)
    if end_of_generation:
        seq.pieces.append(seq.text.flush())
        return "stop"
    text, stopped = _accept(seq, token, piece)
    finished = "stop" if stopped else "length" if len(seq.generated) >= seq.max_tokens else None
    if finished == "length":
        text += seq.text.flush()
    seq.pieces.append(text)
    if finished is None:
        if not seq.on_token("", len(seq.generated)):  # progress for the watchdog; a cancel
            return "cancelled"
        seq.phase, seq.next_token = Phase.DECODE, token
    return finished


def _accept(seq: Sequence, token: int, piece: bytes) -> tuple[str, bool]:
    """``token`` taken as if sampled: the sampler told of it (its penalties, a grammar's state, thinking's phases),
    it joins ``generated``, its piece the text; the text that goes out now, and whether a stop string ended it."""
    seq.sampler.accept([token])
    seq.generated.append(token)
    return seq.text.push(piece)
