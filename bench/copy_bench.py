"""A prompt admitted beside a long-running sequence, sharing with it only its first tokens: its time to the first
token when the worker copies the other slot's cells for them (every copy made, as before the engine measured what
a copy costs), when it computes them (no copy), and under the costs the engine measured as it loaded
(``mpserve.engine.copy_cost``), in one run of the engine itself on each model (2 slots, a stream of cells each):

    slot 0: a generation held at ``--cells`` cells         slot 1: emptied (as a preempted sequence leaves it),
                                                                   then a short prompt; its first token timed

    python -m bench.copy_bench                        # the built-in tiny model and the two real ones, if installed
    python -m bench.copy_bench --models tiny gemma --cells 1000
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from mpserve.engine.batch import BatchEngine
from mpserve.engine.copy_cost import FREE, CopyCost
from mpserve.engine.interface import GenerateParams
from mpserve.engine.settings import EngineSettings

from .real_models import model_path

NEVER = CopyCost(token_s=0.0, copy_s=float("inf"))
PROMPT = "Reply at once: what is the capital of France? Reply at once: what is the capital of France?"
SAMPLES = 12  # the first two not counted: llama.cpp's graphs for the new shapes


def first_token_s(engine: BatchEngine, n: int) -> float:
    """Seconds from admitting the ``n``-th short prompt into emptied slot 1 to its first token; run to its end."""
    got: list[float] = []
    engine.erase_slot(1)
    started = time.perf_counter()
    engine.admit(1, f"{n}. {PROMPT}", GenerateParams(max_tokens=2, temperature=0.0),
                 lambda text, tokens: got.append(time.perf_counter()) is None)
    while not got and 1 not in engine.free_slots():
        engine.step()
    seconds = (got[0] if got else time.perf_counter()) - started
    while 1 not in engine.free_slots():
        engine.step()
    return seconds


def measure(path: Path, cells: int) -> tuple[CopyCost, dict[str, float]]:
    """The costs the engine measured, and the median first token (s) under each choice."""
    engine = BatchEngine(EngineSettings(str(path), n_ctx=max(2048, cells + 256), parallel=2, threads=2,
                                        n_gpu_layers=0))
    measured = engine._cells.copy_cost
    try:
        engine.admit(0, "Write a long report about the history of", GenerateParams(
            max_tokens=cells + 200, ignore_eos=True, temperature=0.8, seed=1), lambda text, tokens: True)
        while engine.kv_cells(0) < cells:
            engine.step()
        medians = {}
        for name, cost in (("every copy made", FREE), ("none made", NEVER), ("as measured", measured)):
            engine._cells.copy_cost = cost
            medians[name] = statistics.median([first_token_s(engine, n) for n in range(SAMPLES)][2:])
    finally:
        engine.close()
    return measured, medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "gemma", "smollm2"],
                        help="tiny (built in), gemma, smollm2 (the real extra), or GGUF paths")
    parser.add_argument("--cells", type=int, default=1000, help="cells the long-running sequence holds")
    args = parser.parse_args()
    print(f"| model, beside {args.cells} cells | prompt token | stream copy | first token: every copy made | "
          "none made | as measured |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        try:
            path = _path(name)
        except LookupError as exc:
            print(f"| {name} | not installed: {exc} | | | | |")
            continue
        cost, medians = measure(path, args.cells)
        print(f"| {name} | {cost.token_s * 1e3:.3f} ms | {cost.copy_s * 1e3:.3f} ms | "
              + " | ".join(f"{s * 1e3:.2f} ms" for s in medians.values()) + " |")


def _path(name: str) -> Path:
    if name == "tiny":
        from mpserve.models.builtin import default_model_path

        return Path(default_model_path())
    return model_path(name)


if __name__ == "__main__":
    main()
