"""Embeddings per second through a real server: inputs batched inside the worker (one EMBED of ``--batch``
inputs, one decode) against one input per request (``--batch`` EMBEDs sent at once), the same texts.

One instance of the bench model served with ``embedding: true, pooling: mean`` (threads = cores); the modes
take turns, ``--repeat`` times each; the median embeddings/s of each and their ratio are reported.
llama-server ``--embedding`` is not measured here.

    python -m bench.embed_bench                   # bench model, 32 inputs, 3 repeats
    python -m bench.embed_bench --quick           # tiny model: the harness works
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from mpserve import AsyncClient

from .procs import MpserveServer

TEXT = "the {i}th sentence about the cat, the dog and the sea, of all that was and is and will be"


async def measure(address: str, batch: int, repeat: int) -> dict[str, list[float]]:
    texts = [TEXT.format(i=i) for i in range(batch)]
    rates: dict[str, list[float]] = {"batched": [], "one per request": []}
    async with AsyncClient(address, timeout=600) as client:
        await client.embed(texts[:2], model="emb")  # warm
        for _ in range(repeat):
            started = time.perf_counter()
            await client.embed(texts, model="emb")
            rates["batched"].append(batch / (time.perf_counter() - started))
            started = time.perf_counter()
            await asyncio.gather(*(client.embed(t, model="emb") for t in texts))
            rates["one per request"].append(batch / (time.perf_counter() - started))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    model, repeat = ("builtin:tiny-embed", 1) if args.quick else ("builtin:bench", args.repeat)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "embed.yaml"
        config.write_text(yaml.safe_dump({"models": [{"name": "emb", "path": model, "embedding": True,
                                                      "pooling": "mean", "threads": args.threads}]}))
        with MpserveServer("--config", str(config)) as server:
            server.wait_ready()
            rates = asyncio.run(measure(server.address, args.batch, repeat))
    print(f"| {model} as an embedding model, {args.threads} threads, {args.batch} inputs | median embeddings/s "
          "| best |")
    print("|---|---|---|")
    for mode, values in rates.items():
        print(f"| {mode} | {statistics.median(values):.1f} | {max(values):.1f} |")
    batched, single = rates.values()
    print(f"| ratio | {statistics.median(batched) / statistics.median(single):.2f} | "
          f"{max(batched) / max(single):.2f} |")


if __name__ == "__main__":
    main()
