"""Prompt-lookup speculation without a model: n-gram proposals, the acceptance rule against the unspeculated
sampler (a statistical test), draft sizing from decode costs, and the setting's checks."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from mpserve.config import loader as config
from mpserve.config.speculative import Speculative, parse
from mpserve.engine.speculation import Drafter, NgramIndex, RowCosts, verify
from mpserve.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


def test_the_longest_earlier_match_of_the_tail_gives_the_draft() -> None:
    index = NgramIndex(2)
    #             0  1  2  3  4  5  6  7  8  9 10
    index.extend([1, 2, 3, 9, 9, 7, 2, 3, 5, 6, 2])
    assert index.propose(4, 8) == ([], 0)  # the tail (6, 2) occurred only now
    index.extend([3])  # tail 6, 2, 3: (2, 3) ended at 2 and at 7, two tokens matched at either
    drafts, matched = index.propose(4, 3)
    assert drafts == [5, 6, 2] and matched == 2  # the most recent of equally long matches
    index.extend([5, 6])  # tail 2, 3, 5, 6: ends at 9 with four tokens matched
    assert index.propose(4, 8) == ([2, 3, 5, 6], 4)
    assert index.propose(4, 2) == ([2, 3], 4)
    assert index.propose(4, 0) == ([], 0)


def test_a_longer_match_wins_over_a_more_recent_one() -> None:
    index = NgramIndex(1)
    index.extend([4, 5, 6, 1, 9, 6, 2, 4, 5, 6])
    assert index.propose(3, 1) == ([1], 3)  # 4 5 6 at 0..2, not just the 6 at 5


def joint(first: np.ndarray, second: np.ndarray) -> dict[tuple[int, ...], float]:
    """What the unspeculated sampler gives for two tokens: t0 ~ first, t1 ~ second[t0]."""
    return {(a, b): float(first[a] * second[a][b]) for a in range(len(first)) for b in range(len(first))}


def test_verify_draws_what_the_unspeculated_sampler_draws() -> None:
    """Two tokens drawn with a two-token draft (rows: after the prompt, after draft 0, after draft 1) against
    the exact joint law of drawing them one at a time; each pair's frequency over N runs is within 5
    binomial standard errors of its probability, and a chi-square over the pairs stays below its 0.001
    quantile (16 cells: 37.7)."""
    rng = np.random.default_rng(1)
    v = 4
    first = rng.dirichlet(np.ones(v))
    second = rng.dirichlet(np.ones(v), size=v)  # the law of the next token after each first token
    third = rng.dirichlet(np.ones(v), size=v)
    drafts = [int(np.argmax(first)), int(np.argmax(second[int(np.argmax(first))]))]
    n = 20000
    counts: Counter[tuple[int, ...]] = Counter()
    taken = 0
    drawn: list[int] = []

    def sample(row: int) -> tuple[int, str | None]:
        # row i holds the logits after drafts[:i]: they are used only while the draws so far equal them
        assert drawn == drafts[:row]
        law = first if row == 0 else second[drafts[0]] if row == 1 else third[drafts[1]]
        token = int(rng.choice(v, p=law))
        drawn.append(token)
        return token, None

    for _ in range(n):
        drawn.clear()
        result = verify(drafts, sample)
        taken += result.taken
        assert result.tokens == drawn and result.tokens[:result.taken] == drafts[:result.taken]
        if len(result.tokens) == 1:  # the first draw missed draft 0: the second comes from the next step
            result.tokens.append(int(rng.choice(v, p=second[result.tokens[0]])))
        counts[tuple(result.tokens[:2])] += 1
    expected = joint(first, second)
    chi2 = 0.0
    for pair, p in expected.items():
        observed = counts[pair] / n
        assert abs(observed - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-9, (pair, observed, p)
        chi2 += (counts[pair] - n * p) ** 2 / (n * p)
    assert chi2 < 37.7
    assert taken / n == pytest.approx(first[drafts[0]] * (1 + second[drafts[0]][drafts[1]]), abs=0.03)


def test_verify_stops_at_a_finish_and_at_the_first_disagreement() -> None:
    draws = iter([(5, None), (6, "stop")])
    assert verify([5, 6, 7], lambda row: next(draws)) == ([5, 6], 1, "stop")
    draws = iter([(5, None), (8, None)])
    assert verify([5, 6, 7], lambda row: next(draws)) == ([5, 8], 1, None)
    draws = iter([(5, None), (6, None), (7, None), (1, None)])
    assert verify([5, 6, 7], lambda row: next(draws)) == ([5, 6, 7, 1], 3, None)


def test_drafts_are_sized_by_their_cost_and_the_sequences_acceptance() -> None:
    costs = RowCosts()
    for rows in range(1, 8):
        costs.observe(rows, 0.02 + 0.001 * (rows - 1))  # extra rows nearly free (memory-bound decode)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]  # then 3: 4 5 6 7 8 followed 1 2 3 before
    drafter = Drafter(Speculative(n_max=5))
    assert drafter.propose(prompt, [3], 6, 1, costs) == [4, 5, 6]  # at the prior's acceptance, 1/2
    drafter.record(5, 5)
    assert drafter.acceptance > 0.8
    assert drafter.propose(prompt, [3], 6, 1, costs) == [4, 5, 6, 7, 8]
    assert drafter.propose(prompt, [3], 2, 1, costs) == [4, 5]  # the rows the decode has left
    dear = RowCosts()
    for rows in range(1, 8):
        dear.observe(rows, 0.02 * rows)  # a row costs as much as a decode (compute-bound)
    assert Drafter(Speculative()).propose(prompt, [3], 6, 1, dear) == []
    middling = RowCosts()
    for rows in range(1, 8):
        middling.observe(rows, 0.02 * (1 + 0.25 * (rows - 1)))
    for _ in range(20):  # drafts that are never taken: the sequence stops drafting
        drafter.record(3, 0)
    assert drafter.propose(prompt, [3], 6, 1, middling) == []
    assert drafter.proposed == 65 and drafter.accepted == 5


def test_the_setting_is_checked_with_what_is_allowed() -> None:
    assert parse("ngram") == Speculative()
    assert parse({"type": "ngram", "n_max": 4}).n_max == 4
    built = config.build({"models": [{"path": "builtin:tiny", "speculative": {"n_max": 6, "ngram_min": 3}}]})
    assert built.models[0].speculative == Speculative(n_max=6, ngram_min=3)
    assert config.build({}, model={"speculative": "off"}).models[0].speculative is None
    for bad, words in [({"type": "lookup"}, "allowed: ngram, draft"), ({"n_max": 0}, "1 to 64"),
                       ({"size": 2}, "unknown key"), ({"n_min": 5, "n_max": 4}, "at most n_max")]:
        with pytest.raises(ConfigError, match=words):
            config.build({"models": [{"path": "builtin:tiny", "speculative": bad}]})


def test_a_draft_models_drafts_are_sized_with_its_own_decodes_counted_or_fixed() -> None:
    """size(): the k that pays once each draft also costs draft_s (a draft model's decode); sizing fixed:
    n_max whenever there is room; fewer than n_min: none."""
    costs = RowCosts()
    for rows in range(1, 8):
        costs.observe(rows, 0.01 * (1 + 0.05 * (rows - 1)))  # memory-bound: a row costs 5% of a decode
    drafter = Drafter(Speculative(type="draft", model="d.gguf", n_max=4))
    for _ in range(10):
        drafter.record(4, 4)
    assert drafter.size(6, 1, costs) == 4  # free drafts, all taken: as many as n_max
    assert drafter.size(6, 1, costs, draft_s=0.001) == 4  # a draft model a tenth of the model's cost
    assert drafter.size(6, 1, costs, draft_s=0.01) == 0  # as dear as the model itself: drafting never pays
    assert drafter.size(2, 1, costs) == 2  # the rows left
    fixed = Drafter(Speculative(type="draft", model="d.gguf", n_max=3, n_min=2, sizing="fixed"))
    assert fixed.size(6, 1, costs, draft_s=0.01) == 3 and fixed.size(1, 1, costs) == 0
