"""Priority: the time to first token of an urgent request while a batch job keeps every slot busy, against the
same request on the idle server, through a real server (one instance, ``--parallel P``, threads = cores).

    idle      the interactive request (priority 10, a short prompt, a few tokens, streamed) alone, ``--samples``
              times before the load and as many after it: its TTFT p50
    beside    (the floor) a batch client keeps every slot but one busy with long generations: the interactive
              request takes the free slot, no preemption; what it waits for beyond the idle path is the instance's
              step in progress and the CPU the batch takes
    loaded    a batch client keeps every slot busy with long generations (priority 0, ``ignore_eos``) and
              ``--queued`` more waiting, each sent again as it ends; the interactive request ``--samples`` times,
              one after another: its TTFT p50, and the preemptions the server counted
              (``mpserve.server.preemption``: each sample parks a batch sequence, which resumes afterwards)

Target: loaded p50 ≤ 1.5× idle p50. The figure without preemption, for scale, is the batch job's own length: the
interactive request would wait for a slot behind every queued generation.

Every phase paces its samples alike (``--pause`` s of quiet before each, none by default: one after another), so
that the figures differ in the load alone. Paced otherwise they measure the host as much as the server: on a
virtual machine with idle cores, a request after a quiet moment waits for its processes' CPUs to wake (most of it in
the worker's first step, whose threads' CPU had gone to sleep), while a loaded instance keeps its CPUs awake
(docs/benchmarks.md has the figures). Back to back, with more samples than ``MAX_PREEMPTIONS`` per slot, the batch
sequences reach that bound within the run (``mpserve.server.preemption``): the sample after that waits for a slot,
as it should, and shows in the max, not the p50.

    python -m bench.priority                     # bench model, 2 slots, 32 queued, 15 samples
    python -m bench.priority --model PATH        # another GGUF (Gemma 3 270M)
    python -m bench.priority --quick             # tiny model, fewer samples: the harness works
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from dataclasses import dataclass

from mpserve import AsyncClient

from .figures import Target
from .procs import MpserveServer

URGENT = "Reply at once: what is the capital of France?"
BATCH = "Write a long report about the history of"
TARGET = 1.5
PAUSE_S = 0.0  # of quiet before each sample, idle or loaded: none, one after another


async def ttft(client: AsyncClient, n: int, tokens: int) -> float:
    """Seconds from sending the ``n``-th interactive request (a prompt of its own: nothing cached) to its first
    text."""
    started = time.perf_counter()
    first = 0.0
    async for _ in client.stream(f"{n}. {URGENT}", priority=10, max_tokens=tokens, temperature=0):
        first = first or time.perf_counter() - started
    return first


@dataclass(frozen=True)
class Figures:
    idle: list[float]  # TTFTs on the idle server, before the loads and after them
    beside: list[float]  # beside batch requests in all slots but one: no preemption, a busy instance's floor
    loaded: list[float]  # every slot busy and some queued: each one preempts
    preempted: int  # the preemptions counted while loaded


async def paced(client: AsyncClient, numbers: range, tokens: int, pause: float) -> list[float]:
    """The TTFT of each interactive request of ``numbers``, one at a time, each after ``pause`` s of quiet."""
    seconds = []
    for n in numbers:
        await asyncio.sleep(pause)
        seconds.append(await ttft(client, n, tokens))
    return seconds


async def measure(address: str, parallel: int, queued: int, samples: int, tokens: int,
                  batch_tokens: int, pause: float) -> Figures:
    """The interactive request's TTFTs idle, beside a slot left free, then loaded, and the preemptions."""
    async with AsyncClient(address, timeout=3600) as client:
        await ttft(client, -1, tokens)  # warm: the first request after the start is not one of the samples
        idle = await paced(client, range(samples), tokens, pause)
        beside, _ = await under_load(client, parallel - 1, 0, range(samples, 2 * samples), tokens, batch_tokens,
                                     pause)
        loaded, preempted = await under_load(client, parallel, queued, range(2 * samples, 3 * samples), tokens,
                                             batch_tokens, pause)
        idle += await paced(client, range(3 * samples, 4 * samples), tokens, pause)  # idle again: before and
        return Figures(idle, beside, loaded, preempted)  # after, so a change in the host's own load weighs on both


async def under_load(client: AsyncClient, running: int, queued: int, numbers: range, tokens: int,
                     batch_tokens: int, pause: float) -> tuple[list[float], int]:
    """The interactive request's TTFTs while batch requests keep ``running`` slots busy and ``queued`` more waiting
    (each sent again as it ends), and the preemptions counted meanwhile; the batch requests cancelled after."""
    stop = asyncio.Event()

    async def batch(i: int) -> None:
        n = 0
        while not stop.is_set():
            await client.generate(f"{BATCH} {i}.{n}", priority=0, max_tokens=batch_tokens, ignore_eos=True,
                                  temperature=0.8, seed=i)
            n += 1

    load = [asyncio.create_task(batch(i)) for i in range(running + queued)]
    while True:  # those slots busy, the rest queued
        model = next(iter((await client.stats()).models.values()))
        if model.running == running and model.queued >= queued:
            break
        await asyncio.sleep(0.05)
    before = (await client.stats()).counters.get("preempted", 0)
    seconds = await paced(client, numbers, tokens, pause)
    preempted = (await client.stats()).counters.get("preempted", 0) - before
    stop.set()
    for task in load:
        task.cancel()
    await asyncio.gather(*load, return_exceptions=True)
    while (await client.stats()).models and next(iter((await client.stats()).models.values())).running:
        await asyncio.sleep(0.05)  # the batch requests cancelled
    return seconds, preempted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:bench")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--queued", type=int, default=32)
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=8, help="tokens of each interactive request")
    parser.add_argument("--batch-tokens", type=int, default=1024, help="tokens of each batch request")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--pause", type=float, default=PAUSE_S,
                        help="seconds of quiet before each interactive request, idle or loaded (0: back to back)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    model, samples, batch_tokens = ("builtin:tiny", 9, 4096) if args.quick else (
        args.model, args.samples, args.batch_tokens)
    report(model, args.parallel, args.queued, samples, args.tokens, batch_tokens, args.threads, args.pause)


def report(model: str, parallel: int, queued: int, samples: int, tokens: int, batch_tokens: int,
           threads: int, pause: float = PAUSE_S) -> None:
    """Run the measure on its own server and print its table and its target."""
    load = os.getloadavg()[0]
    with MpserveServer("--model", model, "--instances", "1", "--parallel", str(parallel), "--threads",
                       str(threads), "--n-ctx", str(batch_tokens + 64)) as server:
        server.wait_ready()
        f = asyncio.run(measure(server.address, parallel, queued, samples, tokens, batch_tokens, pause))
    idle_p50, loaded_p50 = statistics.median(f.idle), statistics.median(f.loaded)
    print(f"| {model}, 1 instance × parallel {parallel}, {threads} threads, {queued} queued, "
          f"{samples} samples, each after {pause:g} s | TTFT p50 (ms) | max (ms) | p50 against idle |")
    print("|---|---|---|---|")
    for name, seconds in (("idle", f.idle), (f"beside {parallel - 1} batch request(s), a slot free (the floor)",
                                             f.beside), ("loaded, priority 10 (it preempts)", f.loaded)):
        print(f"| {name} | {statistics.median(seconds) * 1000:.1f} | {max(seconds) * 1000:.1f} | "
              f"{statistics.median(seconds) / idle_p50:.2f}× |")
    print(f"\npreemptions: {f.preempted} for {samples} interactive requests; load average (1 min) {load:.1f} "
          f"before, {os.getloadavg()[0]:.1f} after")
    target = Target(f"loaded TTFT p50 ≤ {TARGET}× idle", loaded_p50 / idle_p50, "<=", TARGET)
    print(f"- {target.text}: {target.measured:.2f}× — {'met' if target.met else 'NOT met'}")

if __name__ == "__main__":
    main()
