"""``best_of`` on ``/v1/completions``: B choices generated, the n best returned, ranked as OpenAI ranks them
(the highest mean log-probability per generated token).

    "best_of": B, "n": N  (N <= B)  ->  one request for n = B (``n`` runs them together in one instance), with
                                        logprobs 0 when none were asked for (the ranking needs them)
    B results               ->  the N best, indexed 0..N-1, their logprobs dropped when none were asked for;
                                the usage counts all B, as OpenAI bills them

Not with ``stream`` (OpenAI refuses it too: the best are known only at the end).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from mpserve.client import Result
from mpserve.errors import BadRequest
from mpserve.wire import protocol as wire


@dataclass(frozen=True)
class BestOf:
    keep: int  # the n returned
    drop_logprobs: bool  # asked for only to rank


def requested(given: dict[str, Any], sampling: dict[str, Any], stream: bool) -> BestOf | None:
    """What ``best_of`` asks for (None: nothing beyond ``n``); sets ``sampling``'s n and logprobs for it."""
    best, n = given.get("best_of"), given.get("n", 1)
    if best is None or best == n:
        return None  # n is checked with the other sampling parameters
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= wire.MAX_CHOICES:
        raise BadRequest(f"'n' must be between 1 and {wire.MAX_CHOICES}, got {n!r:.20}")
    if isinstance(best, bool) or not isinstance(best, int) or not n <= best <= wire.MAX_CHOICES:
        raise BadRequest(f"'best_of' must be an integer from n ({n!r:.20}) to {wire.MAX_CHOICES}, got {best!r:.20}")
    if stream:
        raise BadRequest("'best_of' cannot be used with 'stream': the best choices are known only at the end")
    drop = sampling.get("logprobs") is None
    sampling["n"] = best
    if drop:
        sampling["logprobs"] = 0
    return BestOf(n, drop)


def pick(results: list[Result], best: BestOf) -> list[Result]:
    ranked = sorted(results, key=_mean_logprob, reverse=True)[:best.keep]
    return [dataclasses.replace(r, index=i, logprobs=None if best.drop_logprobs else r.logprobs)
            for i, r in enumerate(ranked)]


def _mean_logprob(result: Result) -> float:
    """Over the generated tokens (an echoed prompt's entries come first and do not count)."""
    if result.logprobs is None:
        return -math.inf
    generated = [lp for _, _, lp, _ in result.logprobs.entries()[result.logprobs.prompt:]]
    return sum(generated) / len(generated) if generated else -math.inf
