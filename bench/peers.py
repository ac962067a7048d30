"""Peers: the scaling workload against other servers of the same GGUF on the same cores.

- ``llama_cpp.server``: llama-cpp-python's OpenAI-compatible server; one context, one request at a
  time, ``n_threads`` = cores. Needs the ``llama-cpp-python[server]`` dependencies.
- ``llama-server``: llama.cpp's own server with continuous batching, ``--parallel`` = the highest
  concurrency and ``--threads`` = cores, when a binary is on PATH or given with ``--llama-server``.

mpserve runs one instance per core with one thread each (the target's configuration), one request per
instance at a time; the batching section sets mpserve's ``--parallel`` against llama-server's. All
stream; HTTP peers are driven from a thread per lane with the standard library's http.client.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Callable
from contextlib import ExitStack

from .figures import Case, Figure, Section, Target
from .load import GENERATION_METRICS, LoadResult, http_load, mpserve_load, mpserve_warm_up
from .procs import HttpServer, MpserveServer, free_port
from .settings import Settings

CONCURRENCY = (1, 2, 4, 8)
TARGET_CONCURRENCY = (2, 4, 8)
TARGET = 1.8
SERVER_MODULES = ("fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings")


def run(settings: Settings) -> Section:
    section = Section("peers", "Peers: the same workload on other servers",
                      "each peer server, same GGUF, same cores, same requests")
    peers: dict[str, Callable[[], HttpServer]] = {}
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        section.notes.append(f"llama_cpp.server left out: missing {', '.join(missing)} "
                             "(pip install 'llama-cpp-python[server]').")
    else:
        peers["llama_cpp.server"] = lambda: _llama_cpp_server(settings)
    if settings.llama_server is None:
        section.notes.append("llama-server left out: not on PATH and not given with --llama-server.")
    else:
        peers["llama-server"] = lambda: _llama_server(settings)
    if not peers:
        section.skipped = "no peer server available"
        return section

    work = settings.work
    threads = settings.threads_for(settings.cores)
    per_core = f"{settings.cores}×{threads}"
    cases = {(peer, c): Case({"mpserve": per_core, "vs": peer, "concurrency": str(c)},
                             [Figure(name, unit) for name, unit, _ in GENERATION_METRICS])
             for peer in peers for c in CONCURRENCY}
    with ExitStack() as stack:
        ours = stack.enter_context(MpserveServer("--model", str(settings.model), "--n-ctx", str(work.n_ctx),
                                                 "--instances", str(settings.cores), "--threads", str(threads)))
        theirs = {peer: stack.enter_context(start()) for peer, start in peers.items()}
        ours.wait_ready()
        asyncio.run(mpserve_warm_up(ours.address, work, settings.cores))
        for peer_server in theirs.values():
            peer_server.wait_ready()
            asyncio.run(http_load(peer_server.port, work, 1, 1))
        for _ in range(settings.repeat):
            for c in CONCURRENCY:
                n = work.requests(c)
                served = asyncio.run(mpserve_load(ours.address, work, c, n))
                for peer, peer_server in theirs.items():
                    _add(cases[peer, c], served, asyncio.run(http_load(peer_server.port, work, c, n)))
    section.cases = list(cases.values())
    if "llama_cpp.server" in peers:
        for c in TARGET_CONCURRENCY:
            section.targets.append(Target(f"tokens/s vs llama_cpp.server at concurrency {c}: ≥ {TARGET}×",
                                          cases["llama_cpp.server", c].figure("tokens/s").ratio, ">=",
                                          TARGET))
    section.notes.append(f"mpserve {per_core}: {settings.cores} instances × {threads} thread, one request each at a "
                         "time (the batching section sets mpserve --parallel against llama-server's). "
                         f"llama_cpp.server: 1 context × {settings.cores} threads, logits_all and use_mlock off and "
                         "flash attention on, as in mpserve's engine. llama-server: --parallel "
                         f"{max(CONCURRENCY)} --threads {settings.cores}. n_ctx {work.n_ctx} per request everywhere. "
                         "Workload as in scaling.")
    return section


def _llama_cpp_server(settings: Settings) -> HttpServer:
    port = free_port()
    threads = str(settings.cores)
    return HttpServer([sys.executable, "-m", "llama_cpp.server", "--model", str(settings.model), "--host",
                       "127.0.0.1", "--port", str(port), "--n_threads", threads, "--n_threads_batch", threads,
                       "--n_ctx", str(settings.work.n_ctx), "--interrupt_requests", "False",
                       "--logits_all", "False", "--use_mlock", "False", "--flash_attn", "True"],
                      port, "/v1/models")


def _llama_server(settings: Settings) -> HttpServer:
    assert settings.llama_server is not None
    port = free_port()
    threads = str(settings.cores)
    parallel = max(CONCURRENCY)
    return HttpServer([settings.llama_server, "--model", str(settings.model), "--host", "127.0.0.1", "--port",
                       str(port), "--threads", threads, "--threads-batch", threads, "--parallel", str(parallel),
                       "--ctx-size", str(settings.work.n_ctx * parallel)],
                      port, "/health")


def _add(case: Case, served: LoadResult, peer: LoadResult) -> None:
    for figure, (_, _, read) in zip(case.figures, GENERATION_METRICS, strict=True):
        figure.add(read(served), read(peer))
