"""Adapters: LoRA adapters chosen per request, four of them and the base model in uniform traffic.

    ADAPTERS random adapters of the bench model (``mpserve make-model --lora-for``, seeds 0..3)
    mpserve 2 instances × --parallel 4, the adapters declared with --lora, behind its gateway (--http)
        mixed: 16 lanes at once, request i under adapter i % 5 (the fifth: the base model), chosen by
               llama-server's ``lora`` field [{"id": k, "scale": 1}]
        base:  the same lanes and prompts on the same server, every request on the base model (the baseline of
               the first target)
    llama-server --parallel 8 --no-repack --lora FILE ×4 --lora-init-without-apply: the mixed load, the same
               ``lora`` field per request (its baseline of the second and third targets); over HTTP on both sides
    memory: the host's PSS (the broker and every process under it) of mpserve 2 × 4 with the first adapter and with
            the four, after requests under each: the cost of one more adapter, set against its file's size (not
            measured for adapters under MEMORY_FLOOR_MIB, which two PSS readings differ by more than they cost)

llama.cpp applies adapters per context, so llama-server does not batch requests of different adapters together
(its slots take turns); mpserve routes a request to an instance that runs its set, and an instance's sets take turns
of a few decode steps.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from mpserve.models.lora_maker import write_lora
from mpserve.repack import probe

from .batching import llama_server
from .figures import Case, Figure, Section, Target
from .load import (
    GATEWAY_FIELDS,
    GENERATION_METRICS,
    LLAMA_SERVER_FIELDS,
    LoadResult,
    Workload,
    closed_loop,
    http_request,
)
from .procs import MpserveServer, descendants, free_port, pss_mib, wait_http
from .settings import Settings

ADAPTERS = 4
CONCURRENCY = 16
INSTANCES, PARALLEL = 2, 4
PEER_PARALLEL = 8
VS_BASE, VS_PEER, TTFT_VS_PEER, MEMORY = 0.8, 1.3, 1.0, 1.5
MEMORY_FLOOR_MIB = 1.0  # adapters smaller than this are within the noise of two PSS readings (the tiny model's: KiBs)


def run(settings: Settings) -> Section:
    section = Section("adapters", "LoRA adapters: four and the base model, chosen per request",
                      "the base model alone on the same server; llama-server with the same adapters")
    work = Workload(max_tokens=settings.pick(8, 16), n_ctx=settings.work.n_ctx, min_requests=1,
                    budget_s=settings.work.budget_s)
    metrics = [(name, unit) for name, unit, _ in GENERATION_METRICS]
    ours = f"{INSTANCES}×{PARALLEL}, {ADAPTERS} adapters + base"
    vs_base = Case({"mpserve": ours, "vs": f"{INSTANCES}×{PARALLEL}, base only"}, [Figure(*m) for m in metrics])
    vs_peer = Case({"mpserve": ours, "vs": f"llama-server --parallel {PEER_PARALLEL}, same adapters"},
                   [Figure(*m) for m in metrics])
    with tempfile.TemporaryDirectory() as tmp:
        files = [write_lora(Path(tmp) / f"a{i}.gguf", settings.model, seed=i) for i in range(ADAPTERS)]
        declared = [arg for i, f in enumerate(files) for arg in ("--lora", f"a{i}={f}")]
        threads = str(settings.threads_for(INSTANCES))
        with ExitStack() as stack:
            port = free_port()
            server = stack.enter_context(MpserveServer(
                "--model", str(settings.model), "--n-ctx", str(work.n_ctx), "--instances", str(INSTANCES),
                "--parallel", str(PARALLEL), "--threads", threads, *declared, "--http", f"127.0.0.1:{port}"))
            peer_port = free_port()
            peer = stack.enter_context(llama_server(settings, peer_port, PEER_PARALLEL, work.n_ctx,
                                                    *_peer_flags(files))) if settings.llama_server else None
            server.wait_ready()
            if not wait_http(f"http://127.0.0.1:{port}/health"):
                raise RuntimeError(f"mpserve's gateway did not answer on port {port}")
            asyncio.run(_load(port, work, ADAPTERS + 1, ADAPTERS + 1, GATEWAY_FIELDS, _mixed))  # warm up
            if peer is not None:
                peer.wait_ready()
                asyncio.run(_load(peer_port, work, ADAPTERS + 1, ADAPTERS + 1, LLAMA_SERVER_FIELDS, _mixed))
            n = 2 * CONCURRENCY
            for _ in range(settings.repeat):
                mixed = asyncio.run(_load(port, work, CONCURRENCY, n, GATEWAY_FIELDS, _mixed))
                _add(vs_base, mixed, asyncio.run(_load(port, work, CONCURRENCY, n, GATEWAY_FIELDS, lambda i: {})))
                if peer is not None:
                    _add(vs_peer, mixed, asyncio.run(_load(peer_port, work, CONCURRENCY, n, LLAMA_SERVER_FIELDS,
                                                           _mixed)))
        size = sum(f.stat().st_size for f in files) / len(files) / 2**20
        cost = _adapter_cost(settings, work, files, threads) if size >= MEMORY_FLOOR_MIB else None
    memory = Case({"mpserve": f"{INSTANCES}×{PARALLEL}", "vs": "the adapter's file"},
                  [Figure("host memory per adapter", "MiB")], plotted=False)
    if cost is not None:
        memory.figures[0].add(cost, size)
    else:
        section.notes.append(f"Host memory per adapter not measured: these adapters are {size * 1024:.0f} KiB each, "
                             f"under the {MEMORY_FLOOR_MIB:g} MiB below which two readings of the server's PSS "
                             "differ by more than an adapter costs (the bench model's adapters are measured).")
    section.cases = [vs_base, *([vs_peer] if settings.llama_server else []), *([memory] if cost is not None else [])]
    section.targets.append(Target(f"tokens/s, {ADAPTERS} adapters + base vs the base alone, {CONCURRENCY} at once: "
                                  f"≥ {VS_BASE}×", vs_base.figure("tokens/s").ratio, ">=", VS_BASE))
    if settings.llama_server:
        section.targets += [
            Target(f"tokens/s vs llama-server --parallel {PEER_PARALLEL} with the same adapters (HTTP, both sides): "
                   f"≥ {VS_PEER}×", vs_peer.figure("tokens/s").ratio, ">=", VS_PEER),
            Target("TTFT p50 vs the same llama-server: < 1.0×", vs_peer.figure("TTFT p50").ratio, "<", TTFT_VS_PEER)]
    else:
        section.notes.append("llama-server rows left out: no llama-server binary; put one on PATH or pass "
                             "--llama-server (bench/README.md says how to build it)")
    if cost is not None:
        section.targets.append(Target(f"host memory of one more adapter vs its file, {INSTANCES} instances: "
                                      f"≤ {MEMORY}×", memory.figures[0].ratio, "<=", MEMORY))
    section.notes.append(
        f"Greedy, {work.max_tokens} tokens per request, streamed, {work.n_ctx} tokens of context per sequence, "
        f"{CONCURRENCY} lanes at once; request i runs under adapter i % {ADAPTERS + 1} (the last: the base model), "
        "chosen on both sides by llama-server's lora field. Adapters: rank 8, random (mpserve make-model "
        f"--lora-for), {size:.1f} MiB each. mpserve: {INSTANCES} instances × --parallel {PARALLEL}, {threads} "
        f"threads each; llama-server: --parallel {PEER_PARALLEL}, {settings.cores} threads, --no-repack, "
        "--lora-init-without-apply. Memory: the PSS of the server's processes with the four adapters less with the "
        "first alone, over three.")
    return section


def _mixed(i: int) -> dict[str, Any]:
    """Request ``i``'s adapter: adapter i % 5, or the base model."""
    k = i % (ADAPTERS + 1)
    return {"lora": [{"id": k, "scale": 1.0}]} if k < ADAPTERS else {}


def _peer_flags(files: list[Path]) -> list[str]:
    """llama-server's adapters, none applied unless a request asks, its weights as stored (``llama_server`` says
    --no-repack already where this CPU's repacked kernels crash)."""
    flags = [arg for f in files for arg in ("--lora", str(f))]
    return [*flags, "--lora-init-without-apply", *(["--no-repack"] if probe().works else [])]


async def _load(port: int, work: Workload, concurrency: int, n: int, fields: dict[str, Any],
                chosen: Callable[[int], dict[str, Any]]) -> LoadResult:
    """``bench.load.http_load`` with each request's fields of its own (its adapters)."""
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return await closed_loop(concurrency, n, work.budget_s, lambda i: loop.run_in_executor(
            pool, http_request, port, work, i, {**fields, **chosen(i)}))


def _adapter_cost(settings: Settings, work: Workload, files: list[Path], threads: str) -> float:
    """MiB of host memory (PSS of the server and every process under it) one more adapter adds: a server with all
    four against one with the first alone, each after requests under each of its adapters (so that both compute
    with adapters applied), over three."""
    def host_pss(served: list[Path]) -> float:
        port = free_port()
        declared = [arg for i, f in enumerate(served) for arg in ("--lora", f"a{i}={f}")]
        with MpserveServer("--model", str(settings.model), "--n-ctx", str(work.n_ctx), "--instances",
                           str(INSTANCES), "--parallel", str(PARALLEL), "--threads", threads, *declared,
                           "--http", f"127.0.0.1:{port}") as server:
            server.wait_ready()
            if not wait_http(f"http://127.0.0.1:{port}/health"):
                raise RuntimeError(f"mpserve's gateway did not answer on port {port}")
            every = INSTANCES * PARALLEL * len(served)  # each adapter on every slot of every instance
            asyncio.run(_load(port, work, INSTANCES * PARALLEL, every, GATEWAY_FIELDS,
                              lambda i: {"lora": [{"id": i % len(served), "scale": 1.0}]}))
            return sum(pss_mib(pid) for pid in [server.proc.pid, *descendants(server.proc.pid)])

    return (host_pss(files) - host_pss(files[:1])) / (len(files) - 1)


def _add(case: Case, ours: LoadResult, baseline: LoadResult) -> None:
    for figure, (_, _, read) in zip(case.figures, GENERATION_METRICS, strict=True):
        figure.add(read(ours), read(baseline))
