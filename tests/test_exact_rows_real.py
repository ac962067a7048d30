"""``reuse: exact`` on a real model (Gemma 3 270M Q4_K_M, in-process), its weights repacked for this CPU where
llama.cpp's repacked kernels run here: four sequences decoding together each get the greedy text they get alone.
Repacked weights compute a decode of more than three rows with another kernel (a gemm of four rows at a time), so
the engine splits such decodes (``mpserve.engine.speculation.exact_rows``)."""

from __future__ import annotations

import pytest
from conftest import RealModel
from engines import greedy_together, serve

from mpserve.engine.batch import BatchEngine
from mpserve.engine.settings import EngineSettings
from mpserve.wire.protocol import GenerateParams

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

MAX_TOKENS = 48

PROMPTS = [f"<start_of_turn>user\n{ask}<end_of_turn>\n<start_of_turn>model\n"
           for ask in ("Write a short poem about the sea.", "Name three rivers of Europe.", "What is a steam engine?",
                       "Rewrite this word for word: the keeper climbed the one hundred and twelve steps.")]


def settings(model: RealModel, parallel: int) -> EngineSettings:
    return EngineSettings(model.path, n_ctx=512, parallel=parallel, threads=1, n_gpu_layers=0, repack=True,
                          reuse="exact")


def test_four_sequences_decoded_together_get_the_greedy_text_each_gets_alone(real_model: RealModel) -> None:
    """With the weights repacked (the stored layout's bound of 7 rows is what the other real-model tests run under
    where repacking crashes, as it did on the Intel host of earlier sessions)."""
    if not real_model.repack:
        pytest.skip("llama.cpp's repacked kernels crash on this host (mpserve's probe): mpserve serves without them")
    together = [c.text for c in greedy_together(settings(real_model, len(PROMPTS)), PROMPTS, MAX_TOKENS)]
    engine = BatchEngine(settings(real_model, 1))  # one after another: each prompt shorter than a chunk, none reused
    try:
        alone = [c.text for c in serve(engine, [(p, GenerateParams(max_tokens=MAX_TOKENS, temperature=0.0))
                                                for p in PROMPTS])]
    finally:
        engine.close()
    assert together == alone
