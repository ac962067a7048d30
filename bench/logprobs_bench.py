"""The cost of log-probabilities: tokens/s of ``BatchEngine`` with ``logprobs`` N against none, in-process.

One sequence (K = 1, the case where the per-token numpy work weighs most), greedy, ``--tokens`` per request,
the same prompts; runs without and with log-probabilities take turns, ``--repeat`` times each, and the
median and best of each are reported with their ratio (target: with ≥ 90% of without). The engine's own
counters split a step: time inside ``llama_decode`` and the rest.

    python -m bench.logprobs_bench                     # bench model, N = 5, 3 repeats
    python -m bench.logprobs_bench --top 20 --repeat 5
    python -m bench.logprobs_bench --quick             # tiny model: the harness works
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from mpserve.engine.batch import BatchEngine
from mpserve.engine.settings import EngineSettings
from mpserve.models.builtin import builtin_model_path
from mpserve.wire.protocol import GenerateParams

PROMPTS = ["Once upon a time", "The quick brown fox", "In the beginning", "Hello world"]


def run(engine: BatchEngine, top: int | None, tokens: int) -> float:
    """Tokens/s over one request per prompt, one at a time."""
    generated, started = 0, time.perf_counter()
    for prompt in PROMPTS:
        engine.admit(0, prompt, GenerateParams(max_tokens=tokens, temperature=0, logprobs=top), lambda t, n: True)
        done: list[object] = []
        while not done:
            done = engine.step()
        generated += tokens
    return generated / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    size, tokens, repeat = ("tiny", 16, 1) if args.quick else ("bench", args.tokens, args.repeat)
    engine = BatchEngine(EngineSettings(str(builtin_model_path(size)), n_ctx=512, parallel=1, threads=args.threads,
                                        n_gpu_layers=0))
    try:
        rates: dict[str, list[float]] = {"without": [], f"logprobs {args.top}": []}
        for _ in range(repeat):
            for name, top in (("without", None), (f"logprobs {args.top}", args.top)):
                rates[name].append(run(engine, top, tokens))
    finally:
        engine.close()
    print(f"| {size} model, {args.threads} threads, {tokens} tokens × {len(PROMPTS)} | median tokens/s | best |")
    print("|---|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):.1f} | {max(values):.1f} |")
    without, with_ = rates.values()
    print(f"| ratio | {statistics.median(with_) / statistics.median(without):.3f} | {max(with_) / max(without):.3f} |")


if __name__ == "__main__":
    main()
