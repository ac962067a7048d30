"""Batching: continuous batching through the whole server, against llama-server's, at concurrency K.

For each K, a closed loop of K lanes streams greedy requests to each contender, which take turns within a
repeat (a busy moment on the machine hits all of them):

- ``llama-server --parallel K --threads cores`` (the baseline), with flash attention on its default, auto;
- mpserve ``1×K``: one instance, threads = cores, ``--parallel K``: the configuration the targets are on;
- mpserve ``1×K, a chunk per token``: the same with ``--stream-interval 0``, streaming every token as
  llama-server does, to show what gathering a request's tokens into fewer messages is worth;
- mpserve ``cores×K``: one instance per core, one thread each, ``--parallel K`` each.

Every server holds n_ctx per sequence. llama-server is asked not to reuse a slot's earlier prompt
(``cache_prompt: false``); mpserve reuses a cached prefix only when a prompt shares one, and the prompts
here share nothing but their first characters.
"""

from __future__ import annotations

import asyncio
from contextlib import ExitStack

from .figures import Case, Figure, Section, Target
from .load import GENERATION_METRICS, LoadResult, Workload, http_load, mpserve_load, mpserve_warm_up
from .procs import HttpServer, MpserveServer, free_port
from .settings import Settings

KS = (2, 4, 8)
TARGET = 1.0
TARGET_AT_8 = 1.2
PER_TOKEN = "--stream-interval 0"


def run(settings: Settings) -> Section:
    section = Section("batching", "Batching: mpserve --parallel K against llama-server --parallel K",
                      "llama-server --parallel K, same threads, same GGUF (column vs)")
    if settings.llama_server is None:
        section.skipped = ("no llama-server binary: put one on PATH or pass --llama-server (bench/README.md says "
                           "how to build it from the llama-cpp-python source archive)")
        return section
    cores = settings.cores
    work = Workload(max_tokens=settings.pick(8, 64), n_ctx=settings.work.n_ctx, min_requests=1,
                    budget_s=settings.work.budget_s)
    ks = (2,) if settings.quick else KS
    for k in ks:
        contenders = {f"1×{k}": ["--instances", "1", "--threads", str(cores), "--parallel", str(k)],
                      f"1×{k}, a chunk per token": ["--instances", "1", "--threads", str(cores), "--parallel", str(k),
                                                    *PER_TOKEN.split()],
                      f"{cores}×{k}, 1 thread each": ["--instances", str(cores), "--threads", "1", "--parallel",
                                                      str(k)]}
        cases = {name: Case({"mpserve instances×slots": name, "vs": f"llama-server --parallel {k}",
                             "concurrency": str(k)}, [Figure(m, unit) for m, unit, _ in GENERATION_METRICS])
                 for name in contenders}
        _measure(settings, work, k, contenders, cases)
        section.cases += cases.values()
        threshold = TARGET_AT_8 if k == 8 else TARGET
        section.targets.append(Target(f"batching 1×{k} tokens/s vs llama-server --parallel {k} at concurrency {k}: "
                                      f"≥ {threshold}×", cases[f"1×{k}"].figure("tokens/s").ratio, ">=", threshold))
    section.notes.append(
        f"Greedy, {work.max_tokens} tokens per request, streamed, {work.n_ctx} tokens of context per sequence, "
        "3 requests per lane, contenders taking turns within each repeat. mpserve streams a request's first token "
        "at once and gathers later ones into a chunk at most every 20 ms (its default stream_interval); the rows "
        f"'a chunk per token' ({PER_TOKEN}) send a message per token, as llama-server sends a server-sent event "
        "per token. Flash attention: auto on both sides (on, on a CPU).")
    return section


def _measure(settings: Settings, work: Workload, k: int, contenders: dict[str, list[str]],
             cases: dict[str, Case]) -> None:
    with ExitStack() as stack:
        port = free_port()
        peer = stack.enter_context(HttpServer(
            [str(settings.llama_server), "--model", str(settings.model), "--host", "127.0.0.1", "--port", str(port),
             "--threads", str(settings.cores), "--threads-batch", str(settings.cores), "--parallel", str(k),
             "--ctx-size", str(work.n_ctx * k)], port, "/health"))
        ours = {name: stack.enter_context(MpserveServer("--model", str(settings.model), "--n-ctx", str(work.n_ctx),
                                                        *args))
                for name, args in contenders.items()}
        peer.wait_ready()
        asyncio.run(http_load(port, work, k, k))
        for server in ours.values():
            server.wait_ready()
            asyncio.run(mpserve_warm_up(server.address, work, k))
        n = 3 * k
        for _ in range(settings.repeat):
            baseline = asyncio.run(http_load(port, work, k, n))
            for name, server in ours.items():
                _add(cases[name], asyncio.run(mpserve_load(server.address, work, k, n)), baseline)


def _add(case: Case, served: LoadResult, peer: LoadResult) -> None:
    for figure, (_, _, read) in zip(case.figures, GENERATION_METRICS, strict=True):
        figure.add(read(served), read(peer))
