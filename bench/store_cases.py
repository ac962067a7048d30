"""The host store's cases of the batching section: prompts that outlive the instance that computed them.

    tenants  ─▶ 4 instances of one slot, TENANTS system prompts of about 1,500 tokens each, asked in a seeded
                random order, one at a time: the host store (every instance restores what any computed) against
                per-instance caches with the same total RAM (4 single-instance models, each with its own store of
                a quarter of it, and a prompt sent to the instance that computed its system prompt before when it
                is free: how the broker routed to per-instance caches). Figures: hit rate (requests that restored
                their system prompt) and median time to first token; a repeat is a new set of system prompts.
    swap     ─▶ single active backend, models A and B (the same GGUF under two names) on one simulated GPU:
                A's long prompt after B's turn, cold (a prompt A never saw) against restored (one A computed
                before B took the GPU: A's instance is gone, the host store is not). Both include A's reload.

Each server gets a store folder of its own (``--cache-shm``), so no case restores what another computed. The
batching section runs both; alone:

    python -m bench.store_cases [--model GGUF] [--repeat 3] [--cases tenants,swap]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Protocol

import yaml

from mpserve import AsyncClient

from .figures import Case, Figure, Section, Target
from .load import PROMPTS
from .procs import MpserveServer
from .settings import Settings

INSTANCES = 4
TOTAL_RAM_MIB = 1024  # the host store's size, and the sum of the per-instance caches' sizes (256 MiB each, the
# per-instance cache_ram default before the host store)
HIT_TOKENS = 512  # a hit restored at least this much of its system prompt (the tenants' share a few tokens)
SWAP_TARGET = 0.2


class TokensLong(Protocol):
    def __call__(self, address: str, text: str, tokens: int, model: str | None = None) -> str:
        """``text`` repeated to ``tokens`` tokens of ``model`` (``bench.batching.tokens_long``)."""


def tenants(settings: Settings, section: Section, tokens_long: TokensLong) -> Case:
    """Hit rate and TTFT of TENANTS system prompts over 4 instances: host store against per-instance caches."""
    count = settings.pick(6, 16)
    length = settings.pick(600, 1500)
    per_tenant = 3
    case = Case({"mpserve instances×slots": f"{INSTANCES}×1, {count} tenants, host store {TOTAL_RAM_MIB}MiB",
                 "vs": f"{INSTANCES} per-instance caches of {TOTAL_RAM_MIB // INSTANCES}MiB", "concurrency": "1"},
                [Figure("hit rate", "%"), Figure("TTFT p50", "ms")], plotted=False)
    threads = str(settings.threads_for(INSTANCES))
    with tempfile.TemporaryDirectory(prefix="mpstore-") as tmp, ExitStack() as stack:
        config = Path(tmp) / "split.yaml"
        config.write_text(yaml.safe_dump({"models": [
            {"name": f"i{i}", "path": str(settings.model), "n_ctx": 2048, "threads": int(threads),
             "cache_ram": f"{TOTAL_RAM_MIB // INSTANCES}MiB", "cache_shm": f"{tmp}/split{i}"}
            for i in range(INSTANCES)]}))
        shared = stack.enter_context(MpserveServer(
            "--model", str(settings.model), "--n-ctx", "2048", "--instances", str(INSTANCES), "--parallel", "1",
            "--threads", threads, "--cache-ram", f"{TOTAL_RAM_MIB}MiB", "--cache-shm", f"{tmp}/shared"))
        split = stack.enter_context(MpserveServer("--config", str(config)))
        shared.wait_ready()
        split.wait_ready()
        for r in range(settings.repeat):
            rng = random.Random(r)
            systems = [tokens_long(shared.address, f"Tenant {r}.{t}. You answer for shop number {t}. "
                                   + " ".join(PROMPTS[t % len(PROMPTS):] + PROMPTS), length) for t in range(count)]
            order = [t for t in range(count) for _ in range(per_tenant)]
            rng.shuffle(order)
            asks = [(t, f"{systems[t]}\nQuestion {i}: {PROMPTS[i % len(PROMPTS)]}") for i, t in enumerate(order)]
            ours = [asyncio.run(_ttft(shared.address, prompt)) for _, prompt in asks]
            holder: dict[int, str] = {}  # tenant -> the instance that computed (and cached) its system prompt
            theirs = []
            for t, prompt in asks:  # a new tenant to the next instance in turn, a known one to its holder
                model = holder.setdefault(t, f"i{len(holder) % INSTANCES}")
                theirs.append(asyncio.run(_ttft(split.address, prompt, model)))
            case.figures[0].add(_hit_rate(ours), _hit_rate(theirs))
            case.figures[1].add(_median_ms(ours), _median_ms(theirs))
    section.notes.append(
        f"Tenants: {count} system prompts of {length} tokens, each asked {per_tenant} times with another question, "
        f"in a seeded random order, one request at a time, 8 tokens generated; {INSTANCES} instances of one slot "
        f"and {threads} threads each. The host store is {TOTAL_RAM_MIB} MiB for all four; the baseline is "
        f"{INSTANCES} models of one instance, each with a store of {TOTAL_RAM_MIB // INSTANCES} MiB of its own, a "
        "tenant sent to the instance that first computed its system prompt (its cache holds it; one request at a "
        "time, so that instance is free), as the broker routed to per-instance caches. A hit is a request whose "
        f"system prompt was restored (timings.cached_tokens ≥ {HIT_TOKENS}: every tenant's shares its first "
        "few tokens with the others', which any slot reuses).")
    return case


def swap(settings: Settings, section: Section, tokens_long: TokensLong) -> Case:
    """Single active backend A → B → A: A's long prompt cold against restored from the host store."""
    length = settings.pick(600, 1500)
    case = Case({"mpserve instances×slots": "A → B → A, single active backend", "vs": "A's prompt cold",
                 "concurrency": "1"}, [Figure("TTFT", "ms")], plotted=False)
    restored: list[int] = []
    with tempfile.TemporaryDirectory(prefix="mpswap-") as tmp:
        config = Path(tmp) / "swap.yaml"
        model = {"path": str(settings.model), "n_ctx": 2048, "threads": settings.cores, "cache_shm": f"{tmp}/store"}
        config.write_text(yaml.safe_dump({"models": [{"name": "a", **model}, {"name": "b", **model}]}))
        with MpserveServer("--config", str(config), "--simulate-gpus", "1x24GiB", "--single-active-backend") as server:
            server.wait_ready()
            for r in range(settings.repeat):
                asyncio.run(_ttft(server.address, "A takes the GPU.", "a"))  # a tokenizes only while it is loaded
                prompt = tokens_long(server.address, f"Swap {r}. " + " ".join(PROMPTS[r % len(PROMPTS):] + PROMPTS),
                                     length, "a")
                asyncio.run(_ttft(server.address, "B takes the GPU.", "b"))
                cold = asyncio.run(_ttft(server.address, prompt + " First question?", "a"))
                asyncio.run(_ttft(server.address, "B takes the GPU again.", "b"))
                again = asyncio.run(_ttft(server.address, prompt + " Second question?", "a"))
                case.figures[0].add(again[0] * 1000, cold[0] * 1000)
                restored.append(again[1])
    section.targets.append(Target(f"single active backend A → B → A, A's long prompt restored vs cold: "
                                  f"≤ {SWAP_TARGET}×", case.figures[0].ratio, "<=", SWAP_TARGET))
    section.notes.append(
        f"Swap: two models (one GGUF under the names a and b) on one simulated GPU with --single-active-backend; "
        f"a prompt of {length} tokens to a after b's turn, cold (new to a) and, after b's turn again, restored from "
        "the host store (a's instance was unloaded in between); both include a's reload. Tokens restored per "
        f"repeat: {', '.join(map(str, restored))}.")
    return case


async def _ttft(address: str, prompt: str, model: str | None = None) -> tuple[float, int]:
    """Seconds to the first streamed token, and the prompt tokens the worker restored or reused."""
    async with AsyncClient(address) as client:
        stream = client.stream(prompt, max_tokens=8, temperature=0.0, model=model, timeout=600)
        started = time.perf_counter()
        first = 0.0
        async for _ in stream:
            first = first or time.perf_counter()
        assert stream.result is not None
        return first - started, stream.result.timings.cached_tokens


def _hit_rate(results: list[tuple[float, int]]) -> float:
    return 100 * sum(1 for _, cached in results if cached >= HIT_TOKENS) / len(results)


def _median_ms(results: list[tuple[float, int]]) -> float:
    ordered = sorted(seconds for seconds, _ in results)
    return 1000 * ordered[len(ordered) // 2]



def main() -> None:
    from mpserve.models.builtin import builtin_model_path

    from .batching import ratio_line, tokens_long

    parser = argparse.ArgumentParser(prog="python -m bench.store_cases", description="the host store's own cases")
    parser.add_argument("--model", type=Path, help="GGUF file [default: the built-in bench model]")
    parser.add_argument("--repeat", type=int, default=3, help="repeats [default: %(default)s]")
    parser.add_argument("--cases", default="tenants,swap", help="some of %(default)s")
    args = parser.parse_args()
    settings = Settings.make(quick=False, repeat=args.repeat, model=args.model or builtin_model_path("bench"),
                             llama_server=None)
    runs = {"tenants": tenants, "swap": swap}
    with tempfile.TemporaryDirectory(prefix="mpsc-", dir="/tmp") as runtime:
        os.environ["MPSERVE_RUNTIME_DIR"] = runtime
        for name in args.cases.split(","):
            section = Section(name, name, "")
            case = runs[name](settings, section, tokens_long)
            print(f"{name}: {case.labels['mpserve instances×slots']} vs {case.labels['vs']}", flush=True)
            for figure in case.figures:
                print(f"  {ratio_line(figure)}", flush=True)
            print(f"  {section.notes[-1]}", flush=True)


if __name__ == "__main__":
    main()
