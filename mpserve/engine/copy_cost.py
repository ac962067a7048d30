"""Whether a prompt should copy another slot's KV cells or compute the prefix they hold: the two costs, measured.

With a stream of cells per slot (``kv_unified`` off, the default) llama.cpp copies cells from one slot to another
only as a whole stream: every cell of the source's stream, at the next decode, however few tokens the copy is for.
A prompt admitted beside a long-running sequence, sharing with it only the token or two every prompt starts with
(the BOS, a template's first marker), paid for a whole stream to skip computing those: on a small model, more
than its own prefill. So the engine measures both costs once, as it loads, on its own context:

    measure(context) ──a prompt of PROBE_TOKENS tokens, and one of a single token──▶ seconds per further prompt
                        token (the marginal cost of computing one more)
                     ──a single token again, after slot 0's stream was copied into slot 1──▶ seconds a copy adds
                        (the least of up to PROBE_REPEATS tries of each, within PROBE_BUDGET_S)
    CopyCost.worth(saved) ──▶ saved × token_s > copy_s: copy the cells; else compute the tokens

With one pool of cells (``kv_unified``) a copy gives the cells a second owner and costs nothing (``FREE``). A wrong
estimate costs at most its own error once per admission: the tokens computed instead cost no more than the copy was
estimated to.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .context import Context

log = logging.getLogger("mpserve.worker")

PROBE_TOKENS = 8  # the longer probe prompt: long enough to tell a token's cost from a decode's own
PROBE_REPEATS = 3  # tries of each probe at most, the least time kept: what the host's noise did not add ...
PROBE_BUDGET_S = 0.05  # ... while the probes have taken less than this (a start waits for them)


@dataclass(frozen=True)
class CopyCost:
    token_s: float  # seconds one more prompt token adds to a prompt's decode
    copy_s: float  # seconds a stream's copy adds to the decode after it

    def worth(self, saved: int) -> bool:
        """Whether copying cells that hold ``saved`` more prompt tokens costs less than computing them."""
        return saved * self.token_s > self.copy_s


FREE = CopyCost(token_s=1.0, copy_s=0.0)  # one pool of cells: a copy is a second owner, nothing moves


def measure(context: Context) -> CopyCost:
    """The two costs on ``context`` (two slots at least, a stream each), its memory left empty; FREE (every copy
    made) if a probe's decode fails."""
    token = context.bos[0] if context.bos else 0

    def decode(tokens: int, slot: int, pos: int, before: Callable[[], None] = lambda: None) -> float:
        """Seconds of one llama_decode of ``tokens`` prompt tokens into ``slot`` from ``pos`` (``before`` run
        first, untimed: a copy is scheduled, and done by the decode)."""
        batch = context.batch
        batch.n = 0
        batch.add_run([token] * tokens, pos, slot)
        batch.logits[batch.n - 1] = 1
        before()
        started = time.perf_counter()
        if context.lib.llama_decode(context.ctx, batch.view()) != 0:
            raise RuntimeError("llama_decode failed while measuring what a copy of cells costs")
        return time.perf_counter() - started

    def fresh(tokens: int, slot: int) -> float:
        context.seq_rm(slot, -1, -1)
        return decode(tokens, slot, 0)

    def copied() -> float:  # slot 0 holds the longer probe's cells: slot 1 takes them, and goes on after them
        context.seq_rm(1, -1, -1)
        return decode(1, 1, PROBE_TOKENS, before=lambda: context.seq_cp(0, 1, -1, -1))

    one = longer = with_copy = float("inf")
    started = time.perf_counter()
    try:
        for _ in range(PROBE_REPEATS):  # a large model's decodes are long enough to need no second try
            one = min(one, fresh(1, 1))
            longer = min(longer, fresh(PROBE_TOKENS, 0))
            with_copy = min(with_copy, copied())
            if time.perf_counter() - started > PROBE_BUDGET_S:
                break
    except RuntimeError as exc:  # a model whose context takes no such probe: every copy made, as before
        log.warning("could not measure what a copy of a slot's cells costs (%s); every copy is made", exc)
        return FREE
    finally:
        context.batch.n = 0
        context.seq_rm(0, -1, -1)
        context.seq_rm(1, -1, -1)
    return CopyCost(token_s=max(longer - one, 0.0) / (PROBE_TOKENS - 1), copy_s=max(with_copy - one, 0.0))
