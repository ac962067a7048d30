"""Structured output: tokens/s of ``BatchEngine`` with a JSON Schema against the same requests unconstrained.

For each K (1 and 4 sequences per step) the engine runs 2·K requests, K at a time, greedy, every one to
exactly ``--tokens`` tokens: once constrained by SCHEMA (an array of bounded integers longer than the
token budget, so the grammar never closes early and both runs generate the same number of tokens) and
once without, taking turns over ``--repeat`` repeats. Reported per K: tokens/s of each (median over the
repeats), their ratio (target ≥ 0.8), and the time the grammar costs per generated token: the time steps
spend outside ``llama_decode`` (sampling, detokenizing), constrained minus unconstrained, per token; it
is less noisy on a shared machine than the difference of wall times. The grammar sampler runs first in each
sequence's chain (``mpserve.engine.sampling``), over the whole vocabulary: its cost grows with the
vocabulary, which is small in the built-in models.

    python -m bench.structured_bench                     # bench model, K = 1,4, 3 repeats
    python -m bench.structured_bench --quick             # tiny model, 1 repeat: the harness works
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from mpserve.engine.batch import BatchEngine
from mpserve.engine.settings import EngineSettings
from mpserve.models.builtin import builtin_model_path
from mpserve.wire.protocol import GenerateParams

from .load import PROMPTS

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 256,
          "maxItems": 256}


def run(engine: BatchEngine, k: int, params: GenerateParams) -> tuple[int, float, float]:
    """Generated tokens, wall seconds and seconds of steps outside llama_decode (sampling, the grammar
    included, detokenizing) for 2·K requests, K at a time."""
    waiting = [PROMPTS[i % len(PROMPTS)] for i in range(2 * k)]
    before = engine.stats()
    tokens, started = 0, time.perf_counter()
    while waiting or engine.active:
        for slot in engine.free_slots():
            if waiting:
                engine.admit(slot, waiting.pop(), params, lambda text, n: True)
        for _, done in engine.step():
            tokens += done.completion_tokens
    after = engine.stats()
    outside = (after.step_s - after.decode_s) - (before.step_s - before.decode_s)
    return tokens, time.perf_counter() - started, outside


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    model = args.model or str(builtin_model_path("tiny" if args.quick else "bench"))
    repeat, n = (1, 16) if args.quick else (args.repeat, args.tokens)
    plain = GenerateParams(max_tokens=n, temperature=0.0)
    constrained = GenerateParams(max_tokens=n, temperature=0.0, json_schema=json.dumps(SCHEMA))
    print("| K | unconstrained tok/s | JSON schema tok/s | ratio | grammar cost per token |\n|---|---|---|---|---|")
    for k in args.ks:
        engine = BatchEngine(EngineSettings(model, n_ctx=512, parallel=k, threads=args.threads,
                                            n_gpu_layers=args.n_gpu_layers))
        try:
            run(engine, k, plain), run(engine, k, constrained)  # warm; the grammar is parsed once, then cloned
            rates: dict[str, list[float]] = {"plain": [], "schema": []}
            per_token: list[float] = []
            for r in range(repeat):
                (pt, ps, po), (ct, cs, co) = run(engine, k, plain), run(engine, k, constrained)
                assert pt == ct == 2 * k * n, (pt, ct)
                rates["plain"].append(pt / ps)
                rates["schema"].append(ct / cs)
                per_token.append((co - po) / ct)
                print(f"K={k} repeat {r + 1}: {pt / ps:.1f} vs {ct / cs:.1f} tok/s", file=sys.stderr)
        finally:
            engine.close()
        p, c = statistics.median(rates["plain"]), statistics.median(rates["schema"])
        print(f"| {k} | {p:.1f} | {c:.1f} | {c / p:.2f}× | {statistics.median(per_token) * 1e6:.0f} µs |")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a GGUF file (default: the built-in bench model)")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--n-gpu-layers", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
