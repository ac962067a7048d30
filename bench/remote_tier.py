"""The host store's remote tier: a shared-system-prompt workload over two hosts, with and without a Redis under
their stores.

    without ─▶ host A, host B: two servers, each with a host store of its own (--cache-shm), no remote tier
    with    ─▶ the same, both with --cache-remote on a private redis-server (its own port and folder, nothing saved)

    SYSTEMS system prompts of SYSTEM_TOKENS tokens, each asked ASKS times with another question, one request at a
    time; ask q of system prompt s goes to host (q + s) % 2, so its second ask is the first on the other host.

Figures per side: the hit rate (requests whose system prompt was restored or reused: cached_tokens ≥ HIT_TOKENS)
and the median time to first token; and the issue's check, the time to first token of a system prompt's first ask
on the second host: restored from Redis (with) against computed (without), as a ratio. The two hosts are two
servers of this machine with separate host stores; they share its cores, so each has half of them.

    python -m bench.remote_tier [--model GGUF] [--repeat 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from mpserve import AsyncClient
from mpserve.models.builtin import builtin_model_path

from .batching import tokens_long
from .figures import median
from .load import PROMPTS
from .procs import MpserveServer

REDIS_SERVER = "/usr/bin/redis-server"  # Debian's redis-server (tests/run installs it)
SYSTEMS = 4
ASKS = 4
SYSTEM_TOKENS = 1800
HIT_TOKENS = 1024
TARGET = 0.5  # the check: a restore's time to first token at most half a computation's


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.remote_tier", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="GGUF file [default: the built-in bench model]")
    parser.add_argument("--repeat", type=int, default=1, help="repeats, each with new system prompts "
                        "[default: %(default)s]")
    args = parser.parse_args()
    model = str(args.model or builtin_model_path("bench"))
    if not shutil.which(REDIS_SERVER):
        raise SystemExit(f"{REDIS_SERVER} is missing: apt-get install redis-server")
    load = os.getloadavg()[0]
    results = {side: [run_side(model, side == "with", r) for r in range(args.repeat)] for side in ("without", "with")}
    print(f"python -m bench.remote_tier --model {model} --repeat {args.repeat}; {SYSTEMS} system prompts of "
          f"{SYSTEM_TOKENS} tokens, {ASKS} asks each over 2 hosts; load average {load:.1f} → "
          f"{os.getloadavg()[0]:.1f}")
    print("| | hit rate | TTFT p50 (ms) | TTFT of a system prompt's first ask on the second host (ms) |")
    print("| --- | --- | --- | --- |")
    for side, runs in results.items():
        asks = [ask for run in runs for ask in run]
        second = [ttft for run in runs for ttft in _second_host_firsts(run)]
        print(f"| {side} remote tier | {100 * _hit_rate(asks):.0f}% | {median([t for t, _ in asks]):.0f} | "
              f"{median(second):.0f} |")
    restored = median([t for run in results["with"] for t in _second_host_firsts(run)])
    computed = median([t for run in results["without"] for t in _second_host_firsts(run)])
    print(f"restored from Redis ÷ computed: {restored / computed:.2f}× (target ≤ {TARGET}×: "
          f"{'met' if restored / computed <= TARGET else 'NOT met'})")


def run_side(model: str, remote: bool, repeat: int) -> list[tuple[float, int]]:
    """(TTFT ms, cached tokens) of every ask, in order, over two fresh hosts (and a fresh Redis, if ``remote``)."""
    threads = str(max(1, (os.cpu_count() or 2) // 2))
    with tempfile.TemporaryDirectory(prefix="mpremote-") as tmp, ExitStack() as stack:
        extra = [("--cache-remote", f"redis://127.0.0.1:{stack.enter_context(_redis(Path(tmp)))}/0")] if remote else []
        hosts = [stack.enter_context(MpserveServer(
            "--model", model, "--n-ctx", "2560", "--parallel", "1", "--threads", threads, "--cache-ram", "1GiB",
            "--cache-shm", f"{tmp}/host-{name}", *(arg for pair in extra for arg in pair))) for name in "ab"]
        for host in hosts:
            host.wait_ready()
        systems = [tokens_long(hosts[0].address, f"System {repeat}.{s}. You answer for shop number {s}. "
                               + " ".join(PROMPTS[s % len(PROMPTS):] + PROMPTS), SYSTEM_TOKENS)
                   for s in range(SYSTEMS)]
        asks = []
        for q in range(ASKS):
            for s, system in enumerate(systems):
                question = f"{system}\nQuestion {q}: {PROMPTS[(q + s) % len(PROMPTS)]}"
                asks.append(asyncio.run(_ttft(hosts[(q + s) % 2].address, question)))
        return asks


def _second_host_firsts(asks: list[tuple[float, int]]) -> list[float]:
    """The TTFT of each system prompt's second ask: the first on the other host (asks run q-major)."""
    return [ttft for ttft, _ in asks[SYSTEMS:2 * SYSTEMS]]


def _hit_rate(asks: list[tuple[float, int]]) -> float:
    return sum(cached >= HIT_TOKENS for _, cached in asks) / len(asks)


async def _ttft(address: str, prompt: str) -> tuple[float, int]:
    """Milliseconds to the first streamed token, and the prompt tokens restored or reused."""
    async with AsyncClient(address) as client:
        stream = client.stream(prompt, max_tokens=8, temperature=0.0, timeout=600)
        started, first = time.perf_counter(), 0.0
        async for _ in stream:
            first = first or time.perf_counter()
        assert stream.result is not None
        return (first - started) * 1000, stream.result.timings.cached_tokens


@contextmanager
def _redis(folder: Path) -> Iterator[int]:
    """A private redis-server in ``folder``, nothing saved: its port."""
    import socket

    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen([REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--dir", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)
    try:
        yield port
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
