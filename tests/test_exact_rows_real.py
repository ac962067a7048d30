"""``reuse: exact`` on a real model (Gemma 3 270M Q4_K_M, in-process), with its weights as stored and repacked for
this CPU where llama.cpp's repacked kernels run here: four sequences decoding together each get the greedy text
they get alone. Repacked weights compute a decode of more than three rows with another kernel (a gemm of four rows
at a time), so the engine splits such decodes (``mpserve.engine.speculation.exact_rows``)."""

from __future__ import annotations

import pytest
from conftest import RealModel
from engines import greedy_together

from mpserve.engine.interface import Completion
from mpserve.engine.settings import EngineSettings

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

PROMPTS = [f"<start_of_turn>user\n{ask}<end_of_turn>\n<start_of_turn>model\n"
           for ask in ("Write a short poem about the sea.", "Name three rivers of Europe.", "What is a steam engine?",
                       "Rewrite this word for word: the keeper climbed the one hundred and twelve steps.")]


def run(model: RealModel, repack: bool, prompts: list[str]) -> list[Completion]:
    return greedy_together(EngineSettings(model.path, n_ctx=512, parallel=len(prompts), threads=1, n_gpu_layers=0,
                                          repack=repack, reuse="exact"), prompts, 48)


@pytest.mark.parametrize("repack", [False, True], ids=["as-stored", "repacked"])
def test_four_sequences_decoded_together_get_the_greedy_text_each_gets_alone(real_model: RealModel,
                                                                            repack: bool) -> None:
    if repack and not real_model.repack:
        pytest.skip("llama.cpp's repacked kernels crash on this host (mpserve's probe): mpserve serves without them")
    together = [c.text for c in run(real_model, repack, PROMPTS)]
    assert together == [run(real_model, repack, [prompt])[0].text for prompt in PROMPTS]
