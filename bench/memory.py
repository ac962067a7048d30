"""Memory: proportional set size (PSS) of the broker and each worker for 1, 2 and 4 instances.

PSS counts a page shared by k processes as 1/k in each, so the sum over a server's processes is what the
server costs, and weights mapped from the same file by several workers are counted once. Each figure is
set against the model file's size; "per extra instance" is (total with n instances − total with 1) ÷
(n − 1). Every worker has served one request before it is measured, so its buffers are touched. A fresh
Python process that loads the model with ``llama_cpp.Llama`` and runs one request is measured the same way,
for comparison with one worker.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import gguf

from .figures import Case, Figure, Section, Target
from .load import mpserve_warm_up
from .procs import MpserveServer, children, pss_mib
from .settings import Settings

INSTANCES = (1, 2, 4)
DEFAULT_N_CTX = 2048  # mpserve's default context size
TARGET = 0.15
_DIRECT = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=1, flash_attn=True, verbose=False)
llm.create_completion("Hello", max_tokens=4, temperature=0.0)
print("ready", flush=True)
sys.stdin.read()
"""


def run(settings: Settings) -> Section:
    section = Section("memory", "Memory: PSS per process", "the model file's size")
    file_mib = settings.model.stat().st_size / 2**20
    contexts = (settings.work.n_ctx,) if settings.quick else (settings.work.n_ctx, DEFAULT_N_CTX)
    cases: dict[tuple[int, str], Case] = {}
    for n_ctx in contexts:
        cases[n_ctx, "direct"] = Case({"n_ctx": str(n_ctx), "instances": "direct Llama process"},
                                      [Figure("total PSS", "MiB")])
        for n in INSTANCES:
            figures = [Figure("broker PSS", "MiB"), Figure("worker PSS (mean)", "MiB"), Figure("total PSS", "MiB")]
            if n > 1:
                figures.append(Figure("per extra instance", "MiB"))
            cases[n_ctx, str(n)] = Case({"n_ctx": str(n_ctx), "instances": str(n)}, figures)
    for _ in range(settings.repeat):
        for n_ctx in contexts:
            cases[n_ctx, "direct"].figure("total PSS").add(_direct_pss(settings.model, n_ctx), file_mib)
            totals: dict[int, float] = {}
            for n in INSTANCES:
                broker, workers, others = _server_pss(settings, n, n_ctx)
                totals[n] = broker + sum(workers) + others
                case = cases[n_ctx, str(n)]
                case.figure("broker PSS").add(broker, file_mib)
                case.figure("worker PSS (mean)").add(sum(workers) / len(workers), file_mib)
                case.figure("total PSS").add(totals[n], file_mib)
                if n > 1:
                    case.figure("per extra instance").add((totals[n] - totals[1]) / (n - 1), file_mib)
    section.cases = list(cases.values())
    for n_ctx in contexts:
        for n in INSTANCES[1:]:
            extra = cases[n_ctx, str(n)].figure("per extra instance")
            section.targets.append(Target(f"memory per extra instance, {n} instances, n_ctx {n_ctx}: < "
                                          f"{TARGET:.0%} of the model file", extra.ratio, "<", TARGET))
    section.notes.append(f"Model file {file_mib:.0f} MiB. "
                         + "; ".join(f"KV cache at n_ctx {n_ctx}: {_kv_cache_mib(settings.model, n_ctx):.1f} MiB"
                                     for n_ctx in contexts)
                         + " per instance (f16 K and V, allocated whole by llama.cpp). Threads per instance: "
                           "cores ÷ instances. The broker's total includes any other child process it has.")
    return section


def _server_pss(settings: Settings, instances: int, n_ctx: int) -> tuple[float, list[float], float]:
    """PSS of the broker, of each worker, and of any other child of the broker, after a warm-up."""
    with MpserveServer("--model", str(settings.model), "--instances", str(instances), "--n-ctx", str(n_ctx)) as server:
        server.wait_ready()
        asyncio.run(mpserve_warm_up(server.address, settings.work, instances))
        broker = server.proc.pid
        workers = server.worker_pids()
        others = [pid for pid in children(broker) if pid not in workers]
        return pss_mib(broker), [pss_mib(pid) for pid in workers], sum(pss_mib(pid) for pid in others)


def _direct_pss(model: Path, n_ctx: int) -> float:
    proc = subprocess.Popen([sys.executable, "-c", _DIRECT, str(model), str(n_ctx)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the direct llama_cpp process did not load the model")
        return pss_mib(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def _kv_cache_mib(model: Path, n_ctx: int) -> float:
    """f16 K and V for every layer: 2 × layers × n_ctx × (embedding ÷ heads × kv heads) × 2 bytes."""
    reader = gguf.GGUFReader(model)
    arch = _field(reader, "general.architecture")

    def number(key: str) -> int:
        return int(_field(reader, f"{arch}.{key}"))

    n_embd_kv = number("embedding_length") // number("attention.head_count") * number("attention.head_count_kv")
    return 2 * number("block_count") * n_ctx * n_embd_kv * 2 / 2**20


def _field(reader: gguf.GGUFReader, key: str) -> str | int:
    field = reader.fields[key]
    value = field.parts[field.data[0]]
    return bytes(value).decode() if key == "general.architecture" else int(value[0])
