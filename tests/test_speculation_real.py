"""Speculative decoding on a real model (Gemma 3 270M Q4_K_M, in-process): on a copy-heavy prompt most
drafts are taken, and the greedy text is the text without speculation, token for token; with the model
as its own draft model, every draft is taken."""

from __future__ import annotations

import pytest
from conftest import RealModel
from engines import greedy_together

from mpserve.config.speculative import Speculative
from mpserve.engine.interface import Completion
from mpserve.engine.settings import EngineSettings

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

PASSAGE = ("The old lighthouse stood at the end of the harbour wall. Every evening the keeper climbed the one "
           "hundred and twelve steps to the lamp room, wound the clockwork that turned the lens, and lit the "
           "wick. Ships far out at sea saw the beam sweep across the water once every ten seconds.")
COPY = ("<start_of_turn>user\nRewrite this passage word for word, but say 'tower' instead of 'lighthouse':\n\n"
        f"{PASSAGE}<end_of_turn>\n<start_of_turn>model\n")
FREE = "<start_of_turn>user\nWrite a short poem about the sea.<end_of_turn>\n<start_of_turn>model\n"


_PLAIN: dict[tuple[int, tuple[str, ...]], list[Completion]] = {}


def plain(model: RealModel, parallel: int, prompts: list[str]) -> list[Completion]:
    """The completions without speculation (computed once for the tests that compare with them)."""
    key = (parallel, tuple(prompts))
    if key not in _PLAIN:
        _PLAIN[key] = run(model, parallel, None, prompts)
    return _PLAIN[key]


def run(model: RealModel, parallel: int, speculative: Speculative | None, prompts: list[str]) -> list[Completion]:
    # one thread, as the tests' servers have: the suite's other tests share the cores
    return greedy_together(EngineSettings(model.path, n_ctx=1024, parallel=parallel, threads=1, n_gpu_layers=0,
                                          repack=model.repack, speculative=speculative, reuse="exact"), prompts, 64)


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_copy_heavy_prompt_takes_most_drafts_and_keeps_the_greedy_text(real_model: RealModel,
                                                                         parallel: int) -> None:
    prompts = [COPY, FREE][:parallel]
    speculated = run(real_model, parallel, Speculative(), prompts)
    assert [c.text for c in speculated] == [c.text for c in plain(real_model, parallel, prompts)]
    copy = speculated[0]
    assert copy.accepted_tokens > 0, copy  # how many depends on the decode times measured (a loaded machine)


def test_gemma_as_its_own_draft_model_keeps_the_greedy_text_and_has_its_drafts_taken(real_model: RealModel) -> None:
    """The draft model is the model's own file (loaded once, a second context that computes each token in the
    decodes the model computes it in): its greedy drafts are the model's greedy choices, every one is taken,
    and the text is the text without speculation."""
    prompts = [COPY, FREE]  # decoded together: the draft's decodes batch both sequences
    draft = Speculative(type="draft", model=real_model.path, n_max=4, sizing="fixed")
    drafted = run(real_model, 2, draft, prompts)
    assert [c.text for c in drafted] == [c.text for c in plain(real_model, 2, prompts)]
    assert all(0 < c.accepted_tokens == c.draft_tokens for c in drafted), [(c.draft_tokens, c.accepted_tokens)
                                                                          for c in drafted]
