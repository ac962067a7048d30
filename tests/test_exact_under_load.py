"""``reuse: exact`` under load (issue 55): greedy streams of varied prompt lengths, some under a JSON schema, more
of them than slots, each admitted as a slot frees up (so slots are reused), on the tiny model in-process. Each gets
what its prompt gets run alone in a fresh engine: the same text, and the same log-probabilities to the last bit (a
logits row that differs at all shows in them, where the tiny model's greedy choices seldom turn). Its weights are
floats, which llama.cpp computes otherwise in a decode of several rows than in a lone row's
(``mpserve.engine.scheduler.together_rows``)."""

from __future__ import annotations

import json

import pytest
from engines import LONG_PROMPT, make_engine, serve

from mpserve.engine.interface import Completion
from mpserve.wire.protocol import GenerateParams

pytestmark = pytest.mark.timeout(120)

SCHEMA = json.dumps({"type": "object", "required": ["name", "items"], "properties": {
    "name": {"type": "string"}, "items": {"type": "array", "items": {"type": "integer"}}}},
    sort_keys=True, separators=(",", ":"))
WORDS = [3, 40, 150, 300, 90, 600, 10, 220]  # prompt lengths in words: short, long, over a prompt chunk
MAX_TOKENS = [200, 120, 300, 60]


def requests(n: int) -> list[tuple[str, GenerateParams]]:
    """``n`` greedy requests asking for log-probabilities, every fourth under a JSON schema."""
    words = LONG_PROMPT.split()
    return [(f"story {i}: " + " ".join(words[i * 7 % 50:i * 7 % 50 + WORDS[i % len(WORDS)]]),
             GenerateParams(max_tokens=MAX_TOKENS[i % len(MAX_TOKENS)], temperature=0.0, logprobs=2,
                            json_schema=SCHEMA if i % 4 == 0 else None))
            for i in range(n)]


def alone(model_path: str, prompt: str, params: GenerateParams) -> Completion:
    engine = make_engine(model_path, 1, flash_attn="auto")
    try:
        return serve(engine, [(prompt, params)])[0]
    finally:
        engine.close()


def test_every_stream_under_load_gets_what_it_gets_alone(tiny_model_path: str) -> None:
    """Twelve streams on four slots (flash attention as the servers have it): short ones decoding together while
    long ones decode alone, prompts computed while others decode."""
    load = requests(12)
    engine = make_engine(tiny_model_path, 4, flash_attn="auto")
    try:
        together = serve(engine, load)
    finally:
        engine.close()
    differ = [i for i, ((prompt, params), got) in enumerate(zip(load, together, strict=True))
              if (got.text, got.logprobs) != ((want := alone(tiny_model_path, prompt, params)).text, want.logprobs)]
    assert not differ, f"streams {differ} got other numbers than alone"
