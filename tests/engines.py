"""The in-process engine driver the engine tests share: engines and llama.cpp references on the tiny model,
loops that run requests through an engine, and the prompts several tests use."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import llama_cpp

from mpserve.engine.batch import BatchEngine
from mpserve.engine.copy_cost import FREE
from mpserve.engine.interface import Completion
from mpserve.engine.settings import EngineSettings
from mpserve.wire.protocol import GenerateParams

N_CTX = 1024
PROMPTS = [
    "The quick brown fox",
    "Once upon a time in the land of",
    "Hello",
    "In the beginning was the word, and the word was",
    "4 + 4 =",
    "It was the best of times, it was the worst of times",
]
LONG_PROMPT = " ".join(f"the {w} of all and" for w in ("cat", "dog", "sea", "sky") * 30)  # 931 tokens


def others(n: int) -> list[str]:
    """``n`` long prompts unrelated to LONG_PROMPT from their first token, each at least one whole chunk."""
    return [f"{i} " + " ".join(f"so {w} and it" for w in ("ant", "bee", "owl", "elk") * 25) for i in range(n)]


def make_llama(model_path: str, flash_attn: str = "off") -> llama_cpp.Llama:
    """Llama has flash attention on or off; auto is on on a CPU."""
    return llama_cpp.Llama(model_path, n_ctx=N_CTX, n_threads=1, n_threads_batch=1, flash_attn=flash_attn != "off",
                           verbose=False)


def scoring_llama(path: str, flash_attn: bool) -> llama_cpp.Llama:
    """A Llama that keeps every position's logits (``scores``), to check log-probabilities against."""
    return llama_cpp.Llama(path, n_ctx=N_CTX, n_threads=1, flash_attn=flash_attn, logits_all=True, verbose=False)


def adapters_for(base: str, folder: Path, names: tuple[str, ...]) -> dict[str, str]:
    """Random LoRA adapters for the model ``base`` written in ``folder``: name -> path, adapter i of seed i."""
    from mpserve.models.lora_maker import write_lora

    return {name: str(write_lora(folder / f"{name}.gguf", base, seed=i)) for i, name in enumerate(names)}


def make_engine(model_path: str, parallel: int, budget: int = 64, kv_unified: bool = False,
                flash_attn: str = "off") -> BatchEngine:
    return copying(BatchEngine(EngineSettings(model_path, n_ctx=N_CTX, parallel=parallel, threads=1, n_gpu_layers=0,
                                              step_budget_tokens=budget, kv_unified=kv_unified,
                                              flash_attn=flash_attn, reuse="exact")))  # compared with fresh ones


def copying(engine: BatchEngine) -> BatchEngine:
    """``engine``, copying another slot's cells whenever they hold more of a prompt, whatever the costs it measured
    (``mpserve.engine.copy_cost``): a test of what a copy keeps gets its copy on a busy host too, where the measure
    is noisy. tests/test_copy_cost.py tests the choice itself."""
    engine._cells.copy_cost = FREE
    return engine


def serve(engine: BatchEngine, requests: list[tuple[str, GenerateParams]],
          on_token: Callable[[int], Callable[[str, int], bool]] | None = None) -> list[Completion]:
    """Run ``requests`` through ``engine``, each admitted into the first free slot as soon as one is free;
    ``on_token(i)`` makes request i's callback."""
    results: dict[int, Completion] = {}
    pending = list(enumerate(requests))
    by_slot: dict[int, int] = {}
    while pending or engine.active:
        for slot in engine.free_slots():
            if not pending:
                break
            i, (prompt, params) = pending.pop(0)
            engine.admit(slot, prompt, params, on_token(i) if on_token else lambda text, n: True)
            by_slot[slot] = i
        for slot, completion in engine.step():
            results[by_slot.pop(slot)] = completion
    return [results[i] for i in range(len(requests))]


def finish(engine: BatchEngine) -> dict[int, Completion]:
    """Step ``engine`` until no sequence is active; what each slot completed."""
    done: dict[int, Completion] = {}
    while engine.active:
        done.update(engine.step())
    return done


def greedy_together(settings: EngineSettings, prompts: list[str], max_tokens: int) -> list[Completion]:
    """``prompts`` admitted at once into slots 0, 1, ... of a new engine of ``settings``, greedy, stepped until
    all complete; the engine closed."""
    engine = BatchEngine(settings)
    try:
        for slot, prompt in enumerate(prompts):
            engine.admit(slot, prompt, GenerateParams(max_tokens=max_tokens, temperature=0.0), lambda text, n: True)
        results = finish(engine)
        return [results[slot] for slot in range(len(prompts))]
    finally:
        engine.close()


def run(engine: BatchEngine, slot: int, prompt: str | list[int], max_tokens: int = 16) -> Completion:
    """One greedy request on ``slot``, stepped until it completes."""
    engine.admit(slot, prompt, GenerateParams(max_tokens=max_tokens, temperature=0.0), lambda text, n: True)
    while True:
        done = dict(engine.step())
        if slot in done:
            return done[slot]
