"""Scaling: aggregate tokens/s, TTFT and latency for 1, 2 and 4 instances at concurrency 1, 2, 4, 8.

Each configuration gets threads per instance = cores ÷ instances (at least 1). Its baseline is
``llama_cpp.Llama`` in this process with the same threads, running the same requests in sequence: what
one instance can do with no serving layer at all. The first configuration also runs one request at a
time as whole completions (not streamed), to show what streaming each token costs. One more
configuration, 1 instance × 1 thread at concurrency 2, is the reference for the two-instance target;
and 2 instances × 1 thread are also set against 2 independent llama_cpp processes running the same
requests at once, which is as much as this machine gives two instances whatever serves them. Those
processes load the model right after the server has, and are kept through the repeats, as the in-process
baseline is: on the reference VM a process that has just loaded the model decodes faster than one that
loaded it earlier, so processes started afresh for each repeat would set the bar above any server.

Where the cores fill up, what the serving layer costs shows as CPU time per token, so the one-request row
and the independent-processes row also give it, from the scheduler's counters of every thread:

    mpserve:  decoding = the workers' threads but libzmq's        direct:  decoding = all = every thread of
              all = decoding + the workers' libzmq threads                 the llama_cpp process(es), over
                    + the server process (the broker) + the client         the timed requests

One more row runs the 2 independent processes again while an echo server streams the same messages with
no model (``bench.traffic``: 2 one-slot instances, a piece per token time of the 2 × 1 run, 2 lanes),
against the same processes alone: what the serving path's messages alone take from decoding on these cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from . import load
from .figures import Case, Figure, Section, Target
from .load import GENERATION_METRICS, WHOLE_METRICS, LoadResult
from .procs import CpuMeter, MpserveServer, cpu_seconds
from .settings import Settings
from .traffic import EchoTraffic

CONCURRENCY = (1, 2, 4, 8)
ONE_REQUEST_TARGET = 0.99
TWO_INSTANCES_TARGET = 1.9
INDEPENDENT_TARGET = 0.97  # 2 instances × 1 thread against 2 independent llama_cpp processes
DECODING_CPU = "CPU/token, decoding"
ALL_CPU = "CPU/token, all"


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
BESIDE = "2 direct processes beside echo streams of 2×1's messages"


def run(settings: Settings) -> Section:
    section = Section("scaling", "Scaling: instances × threads per instance, against concurrency",
                      "llama_cpp.Llama in-process, same threads (column vs)")
    work = settings.work
    first = configs(settings)[0]
    cases: dict[tuple[str, int, bool], Case] = {}
    controls: tuple[Case, Case] | None = None  # 2×1 against independent processes; those beside echo streams
    for config in configs(settings):
        runs = [(c, True) for c in config.concurrency] + ([(1, False)] if config == first else [])
        for c, stream in runs:
            cases[config.label, c, stream] = Case(
                {"instances×threads": config.label, "concurrency": str(c), "streamed": "yes" if stream else "no",
                 "vs": SEQUENCE}, [Figure(name, unit) for name, unit, _ in (GENERATION_METRICS if stream else
                                                                           WHOLE_METRICS)], plotted=stream)
            if config == first and (c, stream) == (1, True):
                cases[config.label, c, stream].figures += _cpu_figures()
        if config.label == "2×1":
            controls = (Case({"instances×threads": "2×1", "concurrency": "2", "streamed": "yes", "vs": PARALLEL},
                             [Figure("tokens/s", "tok/s"), *_cpu_figures()], plotted=False),
                        Case({"instances×threads": BESIDE, "concurrency": "2", "streamed": "yes", "vs": PARALLEL},
                             [Figure("tokens/s", "tok/s"), Figure(DECODING_CPU, "ms")], plotted=False))
        _measure(settings, config, {(c, stream): cases[config.label, c, stream] for c, stream in runs},
                 controls if config.label == "2×1" else None)
    section.cases = list(cases.values()) + list(controls or ())
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
    if controls is not None:
        section.targets.append(Target(f"2 instances × 1 thread: ≥ {INDEPENDENT_TARGET:.0%} of 2 independent "
                                      "llama_cpp processes", controls[0].figure("tokens/s").ratio, ">=",
                                      INDEPENDENT_TARGET))
    section.notes.append(f"Greedy, {work.max_tokens} tokens per request, {len(load.PROMPTS)} "
                         f"prompts in turn, n_ctx {work.n_ctx}, streamed through AsyncClient; "
                         f"{work.requests(1)} requests per measurement (2 per lane at concurrency 8), none sent after "
                         f"{work.budget_s:.0f} s. The direct baseline runs the same requests in sequence, so at "
                         "concurrency > 1 latency ratios include queueing and tokens/s ratios show what parallel "
                         "instances add. The row not streamed asks for whole completions (no per-token messages to "
                         "the client), against the same streamed direct runs. The 2×1 row against 2 direct processes "
                         "sets 2 instances against 2 independent llama_cpp processes sharing the same requests "
                         "(loaded right after the server, kept through the repeats): what the machine itself gives "
                         "two instances. CPU/token: the scheduler's time on CPU per streamed token, of the threads "
                         "that decode (mpserve: the workers' own, llama.cpp's among them, not libzmq's) "
                         "and of every process of the run (mpserve: also the broker, the workers' libzmq threads "
                         "and the client; direct: the same threads, there is nothing else). The row beside echo "
                         "streams runs the 2 direct processes again while an echo server (no model) streams 2×1's "
                         "messages, a piece per token time of the 2×1 run: the serving path's cost on these cores "
                         "without mpserve decoding anything.")
    return section


def _measure(settings: Settings, config: Config, cases: dict[tuple[int, bool], Case],
             controls: tuple[Case, Case] | None) -> None:
    """Start ``config``; each repeat runs the direct baseline, then every (concurrency, streamed) case, then,
    with ``controls``, independent direct processes (as many as instances) alone and beside echo streams."""
    work = settings.work
    llm = load.load_direct(str(settings.model), work, config.threads)
    try:
        with MpserveServer("--model", str(settings.model), "--instances", str(config.instances), "--threads",
                           str(config.threads), "--n-ctx", str(work.n_ctx)) as server, \
                contextlib.ExitStack() as stack:
            server.wait_ready()
            apart = stack.enter_context(load.DirectProcesses(str(settings.model), work, config.instances,
                                                             config.threads)) if controls is not None else None
            asyncio.run(load.mpserve_warm_up(server.address, work, config.instances))
            meter = _Meter(server)
            for _ in range(settings.repeat):
                cpu = time.process_time()
                direct = load.direct_load(llm, work, work.requests(1))
                direct_cpu = (time.process_time() - cpu) / max(1, _tokens(direct))
                for (c, stream), case in cases.items():
                    served, use = meter.run(work, c, stream)
                    _add(case, served, direct)
                    if _has_cpu(case):
                        _add_cpu(case, use, Cpu(direct_cpu, direct_cpu))
                if controls is not None and apart is not None:
                    _controls(controls, apart, config, work, meter.last[config.instances, True])
    finally:
        llm.close()


def _controls(controls: tuple[Case, Case], apart: load.DirectProcesses, config: Config, work: load.Workload,
              last: tuple[LoadResult, Cpu]) -> None:
    """The independent processes alone, against the server's run at concurrency = instances, and then beside
    echo streams of that run's messages, against themselves alone."""
    control, beside = controls
    served, use = last
    alone = apart.run(work.requests(config.instances))
    control.figure("tokens/s").add(served.tokens_per_s, alone.tokens_per_s)
    _add_cpu(control, use, Cpu(alone.cpu_s_per_token, alone.cpu_s_per_token))
    with EchoTraffic(config.instances, 1000 * config.instances / served.tokens_per_s, work.max_tokens):
        near = apart.run(work.requests(config.instances))
    beside.figure("tokens/s").add(near.tokens_per_s, alone.tokens_per_s)
    beside.figure(DECODING_CPU).add(near.cpu_s_per_token * 1000, alone.cpu_s_per_token * 1000)


@dataclass(frozen=True)
class Cpu:
    """Seconds on CPU per token: the threads that decode, and every process of the run."""

    decoding_s: float
    all_s: float


class _Meter:
    """Runs a load against ``server`` and reads the CPU time it took, per token, of the threads that decode
    and of every process (the server's, the workers', this client's)."""

    def __init__(self, server: MpserveServer) -> None:
        self._server = server
        self._workers = server.worker_pids()
        self.last: dict[tuple[int, bool], tuple[LoadResult, Cpu]] = {}

    def run(self, work: load.Workload, concurrency: int, stream: bool) -> tuple[LoadResult, Cpu]:
        decoding = -self._decoding()
        with CpuMeter([self._server.proc.pid, *self._workers]) as every:
            result = asyncio.run(load.mpserve_load(self._server.address, work, concurrency,
                                                   work.requests(concurrency), stream=stream))
        decoding += self._decoding()
        tokens = max(1, _tokens(result))
        self.last[concurrency, stream] = result, Cpu(decoding / tokens, (every.others_s + every.own_s) / tokens)
        return self.last[concurrency, stream]

    def _decoding(self) -> float:
        return sum(cpu_seconds(pid, libzmq=False) for pid in self._workers)


def _cpu_figures() -> list[Figure]:
    return [Figure(DECODING_CPU, "ms"), Figure(ALL_CPU, "ms")]


def _has_cpu(case: Case) -> bool:
    return any(f.metric == DECODING_CPU for f in case.figures)


def _add_cpu(case: Case, served: Cpu, direct: Cpu) -> None:
    case.figure(DECODING_CPU).add(served.decoding_s * 1000, direct.decoding_s * 1000)
    case.figure(ALL_CPU).add(served.all_s * 1000, direct.all_s * 1000)


def _tokens(result: LoadResult) -> int:
    return sum(s.tokens for s in result.samples)


def _add(case: Case, served: LoadResult, direct: LoadResult) -> None:
    reads = {name: read for name, _, read in GENERATION_METRICS}
    for figure in case.figures:
        if figure.metric in reads:
            figure.add(reads[figure.metric](served), reads[figure.metric](direct))
