"""A step load against instances that follow the load, fixed 1 and fixed 2 instances, in the same run.

    idle ──▶ CONCURRENCY clients, each streaming one request after another, for STEP seconds ──▶ idle

For each configuration: latency and time to first token (p50, p99) of the step's requests, requests
served, and instance-seconds over the whole run (instances registered or starting, sampled from STATS every
SAMPLE_S; what an operator pays for). Every instance gets ``--threads`` (1 by default), so the
configurations differ in their instance count only.

    python -m bench.step_load [--size bench|tiny] [--step 60] [--concurrency 8] [--idle-after 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from mpserve.client import AsyncClient
from mpserve.models.builtin import builtin_model_path

from .procs import MpserveServer

SAMPLE_S = 0.1
CONFIGS = {"autoscale 1..2": ["--min-instances", "1", "--max-instances", "2"],
           "fixed 1": ["--instances", "1"], "fixed 2": ["--instances", "2"]}


@dataclass(frozen=True)
class Outcome:
    config: str
    requests: int
    latency_p50_ms: float
    latency_p99_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    instance_seconds: float
    most_instances: int


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def step(address: str, concurrency: int, seconds: float, idle_before: float, idle_after: float,
               max_tokens: int) -> tuple[list[tuple[float, float]], float, int]:
    """(ttft, latency) of every request of the step, instance-seconds of the whole run, most instances."""
    async with AsyncClient(address, timeout=120) as client:
        timings: list[tuple[float, float]] = []
        live = [0.0, 0]  # instance-seconds, most instances
        running = True

        async def sample() -> None:
            last = time.perf_counter()
            while running:
                await asyncio.sleep(SAMPLE_S)
                model = next(iter((await client.stats()).models.values()))
                now = time.perf_counter()
                count = model.instances + model.scaling.starting
                live[0] += count * (now - last)
                live[1] = max(int(live[1]), count)
                last = now

        async def lane(lane_id: int, until: float) -> None:
            i = 0
            while time.perf_counter() < until:
                started = time.perf_counter()
                first = None
                async for _ in client.stream(f"step {lane_id} {i}", max_tokens=max_tokens, temperature=0):
                    first = first or time.perf_counter()
                done = time.perf_counter()
                timings.append(((first or done) - started, done - started))
                i += 1

        sampler = asyncio.create_task(sample())
        await asyncio.sleep(idle_before)
        until = time.perf_counter() + seconds
        await asyncio.gather(*(lane(n, until) for n in range(concurrency)))
        await asyncio.sleep(idle_after)
        running = False
        await sampler
        return timings, float(live[0]), int(live[1])


def measure(config: str, model: str, args: argparse.Namespace) -> Outcome:
    with MpserveServer("--model", model, "--n-ctx", "512", "--threads", str(args.threads), *CONFIGS[config],
                       "--scale-up-after",
                       str(args.scale_up_after), "--scale-down-after", str(args.scale_down_after)) as server:
        server.wait_ready()
        timings, instance_seconds, most = asyncio.run(step(server.address, args.concurrency, args.step,
                                                           args.idle_before, args.idle_after, args.max_tokens))
    ttft = [t * 1000 for t, _ in timings]
    latency = [t * 1000 for _, t in timings]
    return Outcome(config, len(timings), statistics.median(latency), percentile(latency, 0.99),
                   statistics.median(ttft), percentile(ttft, 0.99), instance_seconds, most)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("bench", "tiny"), default="bench")
    parser.add_argument("--step", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--idle-before", type=float, default=5.0)
    parser.add_argument("--idle-after", type=float, default=15.0)
    parser.add_argument("--scale-up-after", type=float, default=2.0)
    parser.add_argument("--scale-down-after", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads per instance")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    model = str(builtin_model_path(args.size))
    outcomes = []
    for config in CONFIGS:
        print(f"measuring {config} ...", file=sys.stderr)
        outcomes.append(measure(config, model, args))
    if args.json:
        print(json.dumps([asdict(o) for o in outcomes]))
        return
    print(f"step load: {args.concurrency} concurrent streamed requests of {args.max_tokens} tokens for "
          f"{args.step:g} s between {args.idle_before:g} s and {args.idle_after:g} s idle; scale_up_after "
          f"{args.scale_up_after:g} s, scale_down_after {args.scale_down_after:g} s; the {args.size} model, "
          f"{args.threads} thread(s) per instance; load average {os.getloadavg()[0]:.1f} at the end\n")
    print("| config | requests | latency p50 / p99 ms | TTFT p50 / p99 ms | instance-seconds | most instances |")
    print("|---|---|---|---|---|---|")
    for o in outcomes:
        print(f"| {o.config} | {o.requests} | {o.latency_p50_ms:.0f} / {o.latency_p99_ms:.0f} | "
              f"{o.ttft_p50_ms:.0f} / {o.ttft_p99_ms:.0f} | {o.instance_seconds:.1f} | {o.most_instances} |")


if __name__ == "__main__":
    main()
