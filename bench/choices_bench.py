"""n choices against separate requests: ``n: 4`` in one request against four requests sent at once, on a
~1,000-token prompt, through a real server (one instance, ``--parallel 4``, threads = cores), streamed.

Both ask for the same thing: four sampled completions of one prompt, seeds s..s+3. Each repeat uses a
prompt the server has not seen (another first word), so neither side starts from cached cells; the modes
take turns. Reported per mode, median over the repeats: the time to the first text of any choice, to the
first text of every choice, and to the end of the last; and the prompt tokens computed (from the DONEs:
prompt minus cached tokens, summed over the four).

    python -m bench.choices_bench                 # bench model, 3 repeats
    python -m bench.choices_bench --quick         # tiny model: the harness works
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from mpserve import AsyncClient, Result

from .procs import MpserveServer

N = 4
PREAMBLE = " ".join(f"the {w} of all and" for w in ("cat", "dog", "sea", "sky") * 30)  # about 930 tokens


async def together(client: AsyncClient, prompt: str, tokens: int, seed: int) -> tuple[list[float], list[Result]]:
    """One request for N choices: when each choice's first text came, and the results."""
    started = time.perf_counter()
    first: dict[int, float] = {}
    stream = client.stream(prompt, n=N, max_tokens=tokens, temperature=0.8, seed=seed, ignore_eos=True)
    async for _ in stream:
        first.setdefault(stream.chunk_index, time.perf_counter() - started)
    return [first[i] for i in range(N)], stream.results


async def separate(client: AsyncClient, prompt: str, tokens: int, seed: int) -> tuple[list[float], list[Result]]:
    """N requests sent at once, seeds seed..seed+N-1."""
    started = time.perf_counter()

    async def one(i: int) -> tuple[float, Result]:
        stream = client.stream(prompt, max_tokens=tokens, temperature=0.8, seed=seed + i, ignore_eos=True)
        first = 0.0
        async for _ in stream:
            first = first or time.perf_counter() - started
        assert stream.result is not None
        return first, stream.result

    done = await asyncio.gather(*(one(i) for i in range(N)))
    return [f for f, _ in done], [r for _, r in done]


async def measure(address: str, repeat: int, tokens: int) -> dict[str, list[tuple[float, float, float, int]]]:
    figures: dict[str, list[tuple[float, float, float, int]]] = {"n: 4": [], "4 requests": []}
    async with AsyncClient(address, timeout=600) as client:
        for r in range(repeat):
            for mode, run in (("n: 4", together), ("4 requests", separate)):
                prompt = f"{mode} {r} {PREAMBLE}"  # unseen: nothing cached
                started = time.perf_counter()
                firsts, results = await run(client, prompt, tokens, seed=100 * r)
                total = time.perf_counter() - started
                computed = sum(x.usage.prompt_tokens - x.timings.cached_tokens for x in results)
                figures[mode].append((min(firsts), max(firsts), total, computed))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    model, tokens, repeat = ("builtin:tiny", 8, 1) if args.quick else ("builtin:bench", args.tokens, args.repeat)
    with MpserveServer("--model", model, "--instances", "1", "--parallel", str(N), "--threads", str(args.threads),
                       "--n-ctx", "1536") as server:
        server.wait_ready()
        figures = asyncio.run(measure(server.address, repeat, tokens))
    print(f"| {model}, 1 instance × parallel {N}, {args.threads} threads, {tokens} tokens per choice | first text "
          "(s) | every choice's first text (s) | total (s) | prompt tokens computed |")
    print("|---|---|---|---|---|")
    for mode, rows in figures.items():
        med = [statistics.median(col) for col in zip(*rows, strict=True)]
        print(f"| {mode} | {med[0]:.3f} | {med[1]:.3f} | {med[2]:.3f} | {med[3]:.0f} |")


if __name__ == "__main__":
    main()
