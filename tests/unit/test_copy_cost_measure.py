"""What ``mpserve.engine.copy_cost.measure`` makes of its probes' times, on a fake context whose decodes take a
known time on a fake clock (a decode of n tokens: a fixed part, n token parts, and a stream's copy if one is due),
how it keeps noise out where it has the time to try again, and what it does when a probe's decode fails."""

from __future__ import annotations

from typing import Any

import pytest

from mpserve.engine import copy_cost
from mpserve.engine.copy_cost import FREE

pytestmark = pytest.mark.timeout(10)

FIXED, TOKEN, COPY, NOISE = 0.010, 0.002, 0.050, 0.030


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeBatch:
    def __init__(self) -> None:
        self.n = 0
        self.logits = [0] * 64

    def add_run(self, tokens: list[int], pos: int, seq: int) -> int:
        self.n += len(tokens)
        return self.n - 1

    def view(self) -> int:
        return self.n


class FakeContext:
    """A context of two slots: a copy (seq_cp) is done by the next decode, which then takes COPY longer; the
    decode whose number is in ``failing`` fails."""

    def __init__(self, clock: Clock, failing: int | None = None, scale: float = 1.0,
                 noisy: frozenset[int] = frozenset()) -> None:
        self.scale, self.noisy = scale, noisy  # all times × scale; the decodes in ``noisy`` take NOISE more
        self.bos = [1]
        self.batch = FakeBatch()
        self.ctx = object()
        self.clock, self.failing, self.decodes = clock, failing, 0
        self.copy_due = False
        self.cells = {0: 0, 1: 0}
        self.lib: Any = self
        self.removed: list[tuple[int, int, int]] = []

    def llama_decode(self, ctx: object, n: int) -> int:
        self.decodes += 1
        if self.decodes == self.failing:
            return 1
        noise = NOISE if self.decodes in self.noisy else 0.0
        self.clock.now += self.scale * (FIXED + n * TOKEN + (COPY if self.copy_due else 0.0) + noise)
        self.copy_due = False
        return 0

    def seq_rm(self, slot: int, p0: int, p1: int) -> bool:
        self.removed.append((slot, p0, p1))
        return True

    def seq_cp(self, source: int, slot: int, p0: int, p1: int) -> None:
        self.copy_due = True


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(copy_cost.time, "perf_counter", fake)
    return fake


def test_the_marginal_token_and_the_copy_are_told_apart_from_a_decodes_fixed_part(clock: Clock) -> None:
    context = FakeContext(clock)
    cost = copy_cost.measure(context)  # type: ignore[arg-type]
    assert (cost.token_s, cost.copy_s) == (pytest.approx(TOKEN), pytest.approx(COPY))
    assert cost.worth(26) and not cost.worth(24)  # 26 tokens cost 0.052 s to compute, the copy 0.05 s
    assert context.removed[-2:] == [(0, -1, -1), (1, -1, -1)] and context.batch.n == 0  # nothing left behind


@pytest.mark.parametrize("failing", [1, 2, 3])  # in each of the three probes (one round: a fake decode is long)
def test_a_probe_whose_decode_fails_leaves_every_copy_made_and_the_memory_empty(clock: Clock, failing: int) -> None:
    context = FakeContext(clock, failing)
    assert copy_cost.measure(context) is FREE  # type: ignore[arg-type]
    assert context.removed[-2:] == [(0, -1, -1), (1, -1, -1)] and context.batch.n == 0


def test_fast_probes_are_tried_again_and_the_host_s_noise_left_out(clock: Clock) -> None:
    scale = 0.05  # a round of probes takes 5 ms: within the budget, three rounds
    context = FakeContext(clock, scale=scale, noisy=frozenset({1, 2, 3}))  # the whole first round slowed
    cost = copy_cost.measure(context)  # type: ignore[arg-type]
    assert context.decodes == 3 * copy_cost.PROBE_REPEATS
    assert (cost.token_s, cost.copy_s) == (pytest.approx(scale * TOKEN), pytest.approx(scale * COPY))


def test_slow_probes_are_tried_once(clock: Clock) -> None:
    context = FakeContext(clock)  # a round of probes takes 0.1 s: past the budget
    copy_cost.measure(context)  # type: ignore[arg-type]
    assert context.decodes == 3
