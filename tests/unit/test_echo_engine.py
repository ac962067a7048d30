"""The echo backend: its prompt cut into pieces, or with a tick, stamped pieces at a fixed pace."""

from __future__ import annotations

import time

import pytest

from mpserve.engine.echo import EchoEngine
from mpserve.wire.protocol import GenerateParams


def _run(engine: EchoEngine, prompt: str, max_tokens: int) -> tuple[list[str], str]:
    pieces: list[str] = []
    engine.admit(0, prompt, GenerateParams(max_tokens=max_tokens), lambda text, n: pieces.append(text) is None)
    while True:
        for _, completion in engine.step():
            return pieces, completion.finish_reason


@pytest.mark.timeout(10)
def test_without_a_tick_the_prompt_comes_back_in_max_tokens_pieces() -> None:
    pieces, reason = _run(EchoEngine(), "abcdefgh", 4)
    assert pieces == ["ab", "cd", "ef", "gh"] and reason == "length"


@pytest.mark.timeout(10)
def test_with_a_tick_each_piece_is_the_time_it_was_made_and_the_pace_is_the_tick() -> None:
    tick = 0.02
    before = time.monotonic_ns()
    pieces, reason = _run(EchoEngine(tick=tick), "x", 6)
    after = time.monotonic_ns()
    stamps = [int(p) for p in pieces]
    assert len(stamps) == 6 and reason == "length" and all(p.endswith(" ") for p in pieces)
    assert before <= stamps[0] and stamps == sorted(stamps) and stamps[-1] <= after
    # the ticks are fixed times from the first step (after ``before``): a loaded machine may make a step late,
    # never one early
    assert all((stamp - before) / 1e9 >= i * tick for i, stamp in enumerate(stamps))
