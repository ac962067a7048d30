"""KV cache types in the engine, in-process: each type llama.cpp offers reaches its context, and quantized
ones take less memory. On the bench model (heads of 64 elements: whole blocks of every quantized type)."""

from __future__ import annotations

import llama_cpp
import pytest

from mpserve.engine.batch import BatchEngine
from mpserve.kv_types import KV_TYPES
from mpserve.models.maker import builtin_model_path
from mpserve.protocol import GenerateParams

PROMPT = "Once upon a time in the land of"


def generate(engine: BatchEngine, prompt: str, max_tokens: int = 8) -> str:
    engine.admit(0, prompt, GenerateParams(max_tokens=max_tokens, temperature=0.0), lambda text, n: True)
    while True:
        for _, completion in engine.step():
            return completion.text


@pytest.mark.timeout(180)
def test_every_kv_type_generates_and_a_quantized_cache_holds_fewer_bytes() -> None:
    path = str(builtin_model_path("bench"))
    state_bytes = {}
    for name in KV_TYPES:
        engine = BatchEngine(path, n_ctx=128, parallel=1, threads=1, n_gpu_layers=0, flash_attn="on",
                             cache_type_k=name, cache_type_v=name)
        try:
            assert generate(engine, PROMPT), name
            state_bytes[name] = llama_cpp.llama_state_seq_get_size(engine._ctx, 0)
        finally:
            engine.close()
    assert state_bytes["q8_0"] < state_bytes["f16"] == state_bytes["bf16"] < state_bytes["f32"]
    assert state_bytes["q4_0"] < state_bytes["q5_0"] < state_bytes["q8_0"]
