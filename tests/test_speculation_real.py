"""Speculative decoding on a real model (Gemma 3 270M Q4_K_M, in-process): on a copy-heavy prompt most
drafts are taken, and the greedy text is the text without speculation, token for token."""

from __future__ import annotations

import pytest
from conftest import RealModel

from mpserve.engine.batch import BatchEngine
from mpserve.engine.interface import Completion
from mpserve.protocol import GenerateParams
from mpserve.speculative import Speculative

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

PASSAGE = ("The old lighthouse stood at the end of the harbour wall. Every evening the keeper climbed the one "
           "hundred and twelve steps to the lamp room, wound the clockwork that turned the lens, and lit the "
           "wick. Ships far out at sea saw the beam sweep across the water once every ten seconds.")
COPY = ("<start_of_turn>user\nRewrite this passage word for word, but say 'tower' instead of 'lighthouse':\n\n"
        f"{PASSAGE}<end_of_turn>\n<start_of_turn>model\n")
FREE = "<start_of_turn>user\nWrite a short poem about the sea.<end_of_turn>\n<start_of_turn>model\n"


def run(model: RealModel, parallel: int, speculative: Speculative | None, prompts: list[str]) -> list[Completion]:
    engine = BatchEngine(model.path, n_ctx=1024, parallel=parallel, threads=2, n_gpu_layers=0, repack=model.repack,
                         speculative=speculative)
    try:
        results: dict[int, Completion] = {}
        for slot, prompt in enumerate(prompts):
            engine.admit(slot, prompt, GenerateParams(max_tokens=64, temperature=0.0), lambda text, n: True)
        while engine.active:
            results.update(engine.step())
        return [results[slot] for slot in range(len(prompts))]
    finally:
        engine.close()


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_copy_heavy_prompt_takes_most_drafts_and_keeps_the_greedy_text(real_model: RealModel,
                                                                         parallel: int) -> None:
    prompts = [COPY, FREE][:parallel]
    plain = run(real_model, parallel, None, prompts)
    speculated = run(real_model, parallel, Speculative(), prompts)
    assert [c.text for c in speculated] == [c.text for c in plain]
    copy = speculated[0]
    assert copy.accepted_tokens > 0, copy  # how many depends on the decode times measured (a loaded machine)
