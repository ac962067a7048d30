"""Memory: proportional set size (PSS) of the broker and each worker for 1, 2 and 4 instances with the default
settings, and for 1 and 2 with each KV cache type (``cache_type_k`` = ``cache_type_v``) without repacking.

PSS counts a page shared by k processes as 1/k in each, so the sum over a server's processes is what the
server costs, and weights mapped from the same file by several workers are counted once. Each figure is
set against the model file's size; "per extra instance" is (total with n instances − total with 1) ÷
(n − 1); a worker's USS (unique set size) is the memory only it holds. Every worker has served one request
before it is measured, so its buffers are touched. An instance's own llama.cpp context (its KV cache, compute and
output buffers, as llama.cpp's log reports them when a context with the same settings is built) is what an extra
instance cannot share: with forked instances (``start_method: fork``) an extra instance should cost no more than
that plus ``CONTEXT_SLACK_MIB`` of its own process. A fresh Python process that loads the model with
``llama_cpp.Llama`` and runs one request is measured the same way, for comparison with one worker.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mpserve.config.kv_types import DEFAULT_KV_TYPE
from mpserve.gpu.placement import estimate_model_memory
from mpserve.repack import host_verdict

from .figures import Case, Figure, Section, Target
from .load import mpserve_warm_up
from .procs import MpserveServer, descendants, pss_mib, uss_mib
from .settings import Settings

INSTANCES = (1, 2, 4)
DEFAULT_N_CTX = 2048  # mpserve's default context size
TARGET = 0.15
CONTEXT_SLACK_MIB = 8.0  # what an extra forked instance may add to its own context: its interpreter's private pages
MEASURED_KV_TYPES = [DEFAULT_KV_TYPE, "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl"]
_DIRECT = """
import sys, llama_cpp
if sys.argv[3] == "off":  # Llama has no parameter for use_extra_bufts: its defaults, with that one off
    defaults = llama_cpp.llama_cpp.llama_model_default_params
    def without_repack():
        params = defaults()
        params.use_extra_bufts = False
        return params
    llama_cpp.llama_cpp.llama_model_default_params = without_repack
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=1, flash_attn=True, verbose=False)
llm.create_completion("Hello", max_tokens=4, temperature=0.0)
print("ready", flush=True)
sys.stdin.read()
"""
_CONTEXT = """
import logging, re, sys
from mpserve.engine.batch import BatchEngine
from mpserve.engine.settings import EngineSettings
sizes = []
class Sizes(logging.Handler):  # llama.cpp's log reaches mpserve.llama (mpserve.engine.llama_log), its INFO as DEBUG
    def emit(self, record):
        found = re.search(r"(?:KV|compute|output) buffer size =\\s*([0-9.]+) MiB", record.getMessage())
        if found:
            sizes.append(float(found.group(1)))
llama = logging.getLogger("mpserve.llama")
llama.setLevel(logging.DEBUG)
llama.addHandler(Sizes())
path, n_ctx, repack, kv = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "on", sys.argv[4]
engine = BatchEngine(EngineSettings(path, n_ctx, 1, 1, 0, repack=repack, cache_type_k=kv, cache_type_v=kv))
print(sum(sizes))
"""


@dataclass(frozen=True)
class Variant:
    """The settings a row is measured with: KV cache type (K and V alike) and repacking (auto: mpserve's default,
    on unless its probe finds the repacked kernels crash on this host; off: --no-repack)."""

    kv: str
    repack: Literal["auto", "off"]

    @property
    def default(self) -> bool:
        return self == DEFAULT

    @property
    def args(self) -> list[str]:
        repack = ["--no-repack"] if self.repack == "off" else []
        return ["--cache-type-k", self.kv, "--cache-type-v", self.kv, *repack]

    def labels(self) -> dict[str, str]:
        return {"kv": self.kv, "repack": self.repack}


DEFAULT = Variant(DEFAULT_KV_TYPE, "auto")


def variants(settings: Settings) -> list[Variant]:
    """The default settings, then each KV type without repacking (on a CPU whose repacked layouts copy the
    weights, such as AMX for f16, that copy would hide what the KV type changes). The tiny model of --quick
    has heads too small for the quantized types."""
    kinds = [DEFAULT_KV_TYPE] if settings.quick else MEASURED_KV_TYPES
    return [DEFAULT, *(Variant(kv, "off") for kv in kinds)]


def run(settings: Settings) -> Section:
    section = Section("memory", "Memory: PSS per process", "the model file's size")
    file_mib = settings.model.stat().st_size / 2**20
    contexts = (settings.work.n_ctx,) if settings.quick else (settings.work.n_ctx, DEFAULT_N_CTX)
    cases: dict[tuple[int, Variant, str], Case] = {}
    for n_ctx in contexts:
        cases[n_ctx, DEFAULT, "direct"] = Case({"n_ctx": str(n_ctx), "instances": "direct Llama process",
                                                **DEFAULT.labels()}, [Figure("total PSS", "MiB")])
        for variant in variants(settings):
            for n in _instances(variant):
                figures = [Figure("broker PSS", "MiB"), Figure("worker PSS (mean)", "MiB"),
                           Figure("worker USS (mean)", "MiB"), Figure("total PSS", "MiB")]
                if n > 1:
                    figures += [Figure("per extra instance", "MiB"), Figure("its llama.cpp context", "MiB")]
                cases[n_ctx, variant, str(n)] = Case({"n_ctx": str(n_ctx), "instances": str(n), **variant.labels()},
                                                     figures)
    for _ in range(settings.repeat):
        for n_ctx in contexts:
            cases[n_ctx, DEFAULT, "direct"].figure("total PSS").add(_direct_pss(settings.model, n_ctx), file_mib)
            for variant in variants(settings):
                totals: dict[int, float] = {}
                for n in _instances(variant):
                    broker, workers, unique, others = _server_pss(settings, n, n_ctx, variant)
                    totals[n] = broker + sum(workers) + others
                    case = cases[n_ctx, variant, str(n)]
                    case.figure("broker PSS").add(broker, file_mib)
                    case.figure("worker PSS (mean)").add(sum(workers) / len(workers), file_mib)
                    case.figure("worker USS (mean)").add(sum(unique) / len(unique), file_mib)
                    case.figure("total PSS").add(totals[n], file_mib)
                    if n > 1:
                        case.figure("per extra instance").add((totals[n] - totals[1]) / (n - 1), file_mib)
                        case.figure("its llama.cpp context").add(_context_mib(settings.model, n_ctx, variant), file_mib)
    section.cases = list(cases.values())
    for n_ctx in contexts:
        for variant in variants(settings):
            for n in _instances(variant)[1:]:
                extra = cases[n_ctx, variant, str(n)].figure("per extra instance")
                settings_text = "default settings" if variant.default else f"KV {variant.kv}, --no-repack"
                section.targets.append(Target(f"memory per extra instance, {n} instances, n_ctx {n_ctx}, "
                                              f"{settings_text}: < {TARGET:.0%} of the model file", extra.ratio, "<",
                                              TARGET))
                context = cases[n_ctx, variant, str(n)].figure("its llama.cpp context")
                if extra.values and context.values:
                    over = statistics.median(extra.values) - statistics.median(context.values)
                    section.targets.append(Target(
                        f"memory per extra instance beyond its own llama.cpp context, {n} instances, n_ctx {n_ctx}, "
                        f"{settings_text}", over, "<=", CONTEXT_SLACK_MIB, "MiB"))
    kv_sizes = "; ".join(f"n_ctx {n_ctx}: " + ", ".join(
        f"{v.kv} {_kv_cache_mib(settings.model, n_ctx, v.kv):.1f}" for v in variants(settings)[1:])
        for n_ctx in contexts)
    section.notes.append(f"Model file {file_mib:.0f} MiB. KV cache per instance in MiB (K and V of one type, "
                         f"allocated whole by llama.cpp): {kv_sizes}. Threads per instance: cores ÷ instances. "
                         "The total includes the broker's other processes (the fork server, a model's zygote). A "
                         "worker's USS (the pages only it maps) with 2 or more instances is what one more instance "
                         "adds (with one, the model file's pages are its own too, unless a zygote maps them); per "
                         "extra instance counts more where another "
                         "process on the host maps the model file as well.")
    return section


def _instances(variant: Variant) -> tuple[int, ...]:
    return INSTANCES if variant.default else (1, 2)


def _server_pss(settings: Settings, instances: int, n_ctx: int, variant: Variant
                ) -> tuple[float, list[float], list[float], float]:
    """PSS of the broker, PSS and USS of each worker, and PSS of the broker's other descendants (the fork
    server, the zygotes), after a warm-up."""
    with MpserveServer("--model", str(settings.model), "--instances", str(instances), "--n-ctx", str(n_ctx),
                       *variant.args) as server:
        server.wait_ready()
        asyncio.run(mpserve_warm_up(server.address, settings.work, instances))
        broker = server.proc.pid
        workers = server.worker_pids()
        others = [pid for pid in descendants(broker) if pid not in workers]
        return (pss_mib(broker), [pss_mib(pid) for pid in workers], [uss_mib(pid) for pid in workers],
                sum(pss_mib(pid) for pid in others))


def _direct_pss(model: Path, n_ctx: int) -> float:
    repack = "on" if host_verdict().works else "off"  # as mpserve's default decides it
    proc = subprocess.Popen([sys.executable, "-c", _DIRECT, str(model), str(n_ctx), repack], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the direct llama_cpp process did not load the model")
        return pss_mib(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def _context_mib(model: Path, n_ctx: int, variant: Variant) -> float:
    """The KV cache, compute and output buffers llama.cpp allocates for one instance's context with these
    settings (one sequence, as an instance with the default ``parallel``), as its log reports them."""
    repack = "off" if variant.repack == "off" or not host_verdict().works else "on"
    done = subprocess.run([sys.executable, "-c", _CONTEXT, str(model), str(n_ctx), repack, variant.kv],
                          capture_output=True, text=True, timeout=300, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def _kv_cache_mib(model: Path, n_ctx: int, kv: str) -> float:
    return estimate_model_memory(model, n_ctx, -1, 1, kv, kv).kv_cache / 2**20
