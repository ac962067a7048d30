"""Scaling: aggregate tokens/s, TTFT and latency for 1, 2 and 4 instances at concurrency 1, 2, 4, 8.

Each configuration gets threads per instance = cores ÷ instances (at least 1). Its baseline is
``llama_cpp.Llama`` in this process with the same threads, running the same requests in sequence: what
one instance can do with no serving layer at all. The first configuration also runs one request at a
time as whole completions (not streamed), to show what streaming each token costs. One more
configuration, 1 instance × 1 thread at concurrency 2, is the reference for the two-instance target;
and 2 instances × 1 thread are also set against 2 independent llama_cpp processes running the same
requests at once, which is as much as this machine gives two instances whatever serves them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from . import load
from .figures import Case, Figure, Section, Target
from .load import GENERATION_METRICS, WHOLE_METRICS, LoadResult
from .procs import MpserveServer
from .settings import Settings

CONCURRENCY = (1, 2, 4, 8)
ONE_REQUEST_TARGET = 0.97
TWO_INSTANCES_TARGET = 1.9


@dataclass(frozen=True)
class Config:
    instances: int
    threads: int
    concurrency: tuple[int, ...]

    @property
    def label(self) -> str:
        return f"{self.instances}×{self.threads}"


def configs(settings: Settings) -> list[Config]:
    listed = [Config(n, settings.threads_for(n), CONCURRENCY) for n in (1, 2, 4)]
    if Config(1, 1, CONCURRENCY) not in listed:
        listed.insert(1, Config(1, 1, (2,)))  # the reference for the two-instance target
    return listed


SEQUENCE = "1 direct process, requests in sequence"
PARALLEL = "2 direct processes at once"


def run(settings: Settings) -> Section:
    section = Section("scaling", "Scaling: instances × threads per instance, against concurrency",
                      "llama_cpp.Llama in-process, same threads (column vs)")
    work = settings.work
    first = configs(settings)[0]
    cases: dict[tuple[str, int, bool], Case] = {}
    control = None
    for config in configs(settings):
        runs = [(c, True) for c in config.concurrency] + ([(1, False)] if config == first else [])
        for c, stream in runs:
            cases[config.label, c, stream] = Case(
                {"instances×threads": config.label, "concurrency": str(c), "streamed": "yes" if stream else "no",
                 "vs": SEQUENCE}, [Figure(name, unit) for name, unit, _ in (GENERATION_METRICS if stream else
                                                                           WHOLE_METRICS)], plotted=stream)
        if config.label == "2×1":
            control = Case({"instances×threads": "2×1", "concurrency": "2", "streamed": "yes", "vs": PARALLEL},
                           [Figure("tokens/s", "tok/s")], plotted=False)
        _measure(settings, config, {(c, stream): cases[config.label, c, stream] for c, stream in runs},
                 control if config.label == "2×1" else None)
    section.cases = list(cases.values()) + ([control] if control else [])
    for stream in (True, False):
        single = cases[first.label, 1, stream].figure("tokens/s")
        section.targets.append(Target(f"one request, {first.label}, {'streamed' if stream else 'whole'}: ≥ "
                                      f"{ONE_REQUEST_TARGET:.0%} of direct tokens/s", single.ratio, ">=",
                                      ONE_REQUEST_TARGET))
    two, one = cases.get(("2×1", 2, True)), cases.get(("1×1", 2, True))
    if two is not None and one is not None:
        pair = Figure("tokens/s", "tok/s", two.figure("tokens/s").values, one.figure("tokens/s").values)
        section.targets.append(Target(f"2 instances × 1 thread: ≥ {TWO_INSTANCES_TARGET}× of 1 × 1 thread at "
                                      "concurrency 2", pair.ratio, ">=", TWO_INSTANCES_TARGET))
    section.notes.append(f"Greedy, {work.max_tokens} tokens per request, {len(load.PROMPTS)} "
                         f"prompts in turn, n_ctx {work.n_ctx}, streamed through AsyncClient; "
                         f"{work.requests(1)} requests per measurement (2 per lane at concurrency 8), none sent after "
                         f"{work.budget_s:.0f} s. The direct baseline runs the same requests in sequence, so at "
                         "concurrency > 1 latency ratios include queueing and tokens/s ratios show what parallel "
                         "instances add. The row not streamed asks for whole completions (no per-token messages to "
                         "the client), against the same streamed direct runs. The last row sets 2 instances against "
                         "2 independent llama_cpp processes sharing the same requests: what the machine itself "
                         "gives two instances.")
    return section


def _measure(settings: Settings, config: Config, cases: dict[tuple[int, bool], Case], control: Case | None) -> None:
    """Start ``config``; each repeat runs the direct baseline, then every (concurrency, streamed) case, then the
    control (independent direct processes, as many as instances) if there is one."""
    work = settings.work
    llm = load.load_direct(str(settings.model), work, config.threads)
    try:
        with MpserveServer("--model", str(settings.model), "--instances", str(config.instances), "--threads",
                           str(config.threads), "--n-ctx", str(work.n_ctx)) as server:
            server.wait_ready()
            asyncio.run(load.mpserve_warm_up(server.address, work, config.instances))
            for _ in range(settings.repeat):
                direct = load.direct_load(llm, work, work.requests(1))
                served = {}
                for (c, stream), case in cases.items():
                    served[c, stream] = asyncio.run(load.mpserve_load(server.address, work, c, work.requests(c),
                                                                      stream=stream))
                    _add(case, served[c, stream], direct)
                if control is not None:
                    apart = load.parallel_direct_tokens_per_s(str(settings.model), work, config.instances,
                                                              config.threads, work.requests(config.instances))
                    control.figures[0].add(served[config.instances, True].tokens_per_s, apart)
    finally:
        llm.close()


def _add(case: Case, served: LoadResult, direct: LoadResult) -> None:
    reads = {name: read for name, _, read in GENERATION_METRICS}
    for figure in case.figures:
        figure.add(reads[figure.metric](served), reads[figure.metric](direct))
