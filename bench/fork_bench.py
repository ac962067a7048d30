"""Forked instances against spawned ones (``--start-method fork`` and ``spawn``), the same model and load:
decode speed, greedy text, and how soon an extra instance is ready.

    for each repeat, fork and spawn in turn (which goes first alternates):
        N instances × 1 thread (N = 2, 4), N requests at a time ─▶ tokens/s; greedy texts kept
        1 instance, then ``scale`` to 2 ─▶ seconds from the control call until the new instance's slot is idle

A forked instance maps the weights its zygote loaded (copy-on-write pages); a spawned one loads the file itself
(the page cache shares the file's pages, but not what llama.cpp derives from them, such as repacked layouts).
The speed ratio is fork ÷ spawn per repeat; the greedy texts of both must be equal. Run:

    python -m bench.fork_bench [--model PATH] [--repeat N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from mpserve import Client
from mpserve.models.builtin import builtin_model_path
from mpserve.runtime import ServerInfo
from mpserve.wire.slots import SlotState, SlotTable

from .load import Workload, mpserve_load, mpserve_warm_up
from .procs import MpserveServer

METHODS = ("fork", "spawn")
INSTANCES = (2, 4)
SPEED_TARGET = 0.99
READY_TARGET_S = 0.3
WORK = Workload(max_tokens=64, n_ctx=512, min_requests=8, budget_s=30.0)
GREEDY = ["Once upon a time", "The capital of France is", "1, 2, 3,", "def fibonacci(n):"]


def tokens_per_s(model: Path, method: str, instances: int) -> tuple[float, list[str]]:
    """Aggregate tokens/s of ``instances`` 1-thread instances at concurrency ``instances``; the greedy texts."""
    with MpserveServer("--model", str(model), "--instances", str(instances), "--threads", "1", "--n-ctx",
                       str(WORK.n_ctx), "--start-method", method) as server:
        server.wait_ready()
        asyncio.run(mpserve_warm_up(server.address, WORK, instances))
        result = asyncio.run(mpserve_load(server.address, WORK, instances, WORK.requests(instances)))
        with Client(server.address) as client:
            texts = [client.generate(p, max_tokens=24, temperature=0, timeout=120).text for p in GREEDY]
        return result.tokens_per_s, texts


def scale_up_s(model: Path, method: str, folder: Path) -> float:
    """Seconds from asking a 1-instance model to scale to 2 until the new instance's slot is idle."""
    config = folder / f"{method}.yaml"
    config.write_text(f"start_method: {method}\nmodels:\n  - path: {model}\n    name: m\n    n_ctx: {WORK.n_ctx}\n"
                      "    threads: 1\n    instances: {min: 1, max: 2}\n")
    with MpserveServer("--config", str(config)) as server:
        server.wait_ready()
        info = ServerInfo.read(server.name)
        assert info is not None
        table = SlotTable.attach(Path(info.slots), writable=False)
        try:
            with Client(info.admin) as client:  # scaling is an operator's call: the admin socket
                started = time.perf_counter()
                client.control("scale", "m", min=2)
                while sum(row.state is SlotState.IDLE for row in table.read_all()) < 2:
                    if time.perf_counter() - started > 120:
                        raise RuntimeError("the second instance was not ready within 120 s")
                    time.sleep(0.002)
                return time.perf_counter() - started
        finally:
            table.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF file [default: the built-in bench model]")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    model = args.model or builtin_model_path("bench")
    speed: dict[tuple[str, int], list[float]] = {(m, n): [] for m in METHODS for n in INSTANCES}
    ready: dict[str, list[float]] = {m: [] for m in METHODS}
    texts: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeat):
            order = METHODS if repeat % 2 == 0 else METHODS[::-1]
            for n in INSTANCES:
                for method in order:
                    rate, texts[method] = tokens_per_s(model, method, n)
                    speed[method, n].append(rate)
            for method in order:
                ready[method].append(scale_up_s(model, method, Path(folder)))
    print(f"# forked against spawned instances: {model.name}, n_ctx {WORK.n_ctx}, {args.repeat} repeats\n")
    print("| instances × threads | fork tok/s | spawn tok/s | fork ÷ spawn (median, per repeat) | target |")
    print("|---|---|---|---|---|")
    for n in INSTANCES:
        ratios = [f / s for f, s in zip(speed["fork", n], speed["spawn", n], strict=True)]
        print(f"| {n}×1 | {_cell(speed['fork', n])} | {_cell(speed['spawn', n])} | {statistics.median(ratios):.3f} "
              f"({', '.join(f'{r:.3f}' for r in ratios)}) | ≥ {SPEED_TARGET} |")
    print(f"\nscale-up, 1 → 2 instances, until the new slot is idle: fork {_cell(ready['fork'], 's')}, "
          f"spawn {_cell(ready['spawn'], 's')} (target for fork < {READY_TARGET_S} s)")
    equal = texts["fork"] == texts["spawn"]
    print(f"greedy texts of {len(GREEDY)} prompts, fork against spawn: {'equal' if equal else 'DIFFERENT'}")
    return 0 if equal else 1


def _cell(values: list[float], unit: str = "") -> str:
    spread = (max(values) - min(values)) / 2
    return f"{statistics.median(values):.3g}{unit} ±{spread:.2g}"


if __name__ == "__main__":
    raise SystemExit(main())
