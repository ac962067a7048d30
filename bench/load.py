"""The generation workload and the three ways to drive it: mpserve, an HTTP peer, llama_cpp in-process.

Every request is greedy (temperature 0, no repeat penalty), streams its tokens (so time to first token
is seen by the caller; mpserve can also be asked for whole completions) and runs to ``max_tokens`` (the
built-in models never emit end-of-text). Load is
a closed loop: ``concurrency`` lanes each send their next request as soon as the previous one ends,
until ``n`` requests have been sent or the measurement's time budget is spent.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import math
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from mpserve import AsyncClient

from .figures import percentile

PROMPTS = (
    "The old lighthouse keeper climbed the stairs every evening and",
    "In the market square the merchants argued about the price of",
    "She opened the letter slowly, knowing that the news inside would",
    "The recipe called for three eggs, a cup of flour and",
    "When the train stopped in the middle of the night, the passengers",
    "Deep in the forest there was a clearing where the children",
    "The engineer looked at the numbers again and decided that the bridge",
    "After the storm had passed, the fishermen walked down to the harbour to",
)


@dataclass(frozen=True)
class Workload:
    max_tokens: int
    n_ctx: int
    min_requests: int  # per measurement; at least 2 per lane at higher concurrency
    budget_s: float  # a measurement sends no new request after this long (it still waits for those sent)
    preamble: str = ""  # put before every prompt: a system prompt all requests share
    ending: bool = True  # False: the preamble is the whole prompt (a conversation so far)

    def prompt(self, i: int) -> str:
        return self.preamble + (PROMPTS[i % len(PROMPTS)] if self.ending else "")

    def requests(self, concurrency: int) -> int:
        return max(self.min_requests, 2 * concurrency)


@dataclass(frozen=True)
class Sample:
    ttft_s: float  # request sent until the first token arrived
    latency_s: float  # request sent until the last token arrived
    tokens: int
    text: str = ""  # what was generated (HTTP requests only)
    cached: int = 0  # prompt tokens the server reused (HTTP: timings.cached_tokens, llama-server's timings.cache_n)


@dataclass(frozen=True)
class LoadResult:
    samples: list[Sample]
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        return sum(s.tokens for s in self.samples) / self.wall_s

    def ttft_ms(self, percent: float) -> float:
        return percentile([s.ttft_s * 1000 for s in self.samples], percent)

    def latency_ms(self, percent: float) -> float:
        return percentile([s.latency_s * 1000 for s in self.samples], percent)


GENERATION_METRICS: tuple[tuple[str, str, Callable[[LoadResult], float]], ...] = (
    ("tokens/s", "tok/s", lambda r: r.tokens_per_s),
    ("TTFT p50", "ms", lambda r: r.ttft_ms(50)),
    ("TTFT p99", "ms", lambda r: r.ttft_ms(99)),
    ("latency p50", "ms", lambda r: r.latency_ms(50)),
    ("latency p99", "ms", lambda r: r.latency_ms(99)),
)
"""The figures every generation measurement reports: name, unit, how to read it from a LoadResult."""
WHOLE_METRICS = tuple(m for m in GENERATION_METRICS if not m[0].startswith("TTFT"))
"""The figures of requests that are not streamed (the client sees no first token)."""


async def closed_loop(concurrency: int, n: int, budget_s: float,
                      one: Callable[[int], Awaitable[Sample]]) -> LoadResult:
    """``n`` requests from ``concurrency`` lanes, or fewer if the budget runs out (each lane sends one)."""
    counter = itertools.count()
    samples: list[Sample] = []
    started = time.perf_counter()

    async def lane() -> None:
        while (i := next(counter)) < n and (i < concurrency or time.perf_counter() - started < budget_s):
            samples.append(await one(i))

    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return LoadResult(samples, time.perf_counter() - started)


# --- mpserve --------------------------------------------------------------------------------------

async def mpserve_load(address: str, work: Workload, concurrency: int, n: int, *, stream: bool = True) -> LoadResult:
    async with AsyncClient(address) as client:
        return await closed_loop(concurrency, n, work.budget_s, lambda i: mpserve_request(client, work, i, stream))


async def mpserve_request(client: AsyncClient, work: Workload, i: int, stream: bool) -> Sample:
    """One request; not streamed, the first token is not seen, and TTFT is NaN."""
    params = {"max_tokens": work.max_tokens, "temperature": 0.0, "repeat_penalty": 1.0}
    started = time.perf_counter()
    if not stream:
        result = await client.generate(work.prompt(i), **params)
        return Sample(math.nan, time.perf_counter() - started, result.usage.completion_tokens)
    first = 0.0
    chunks = client.stream(work.prompt(i), **params)
    async for _ in chunks:
        first = first or time.perf_counter()
    ended = time.perf_counter()
    assert chunks.result is not None
    return Sample(first - started, ended - started, chunks.result.usage.completion_tokens)


async def mpserve_warm_up(address: str, work: Workload, instances: int) -> None:
    """One request per instance at once, so every worker has run once before anything is timed."""
    await mpserve_load(address, work, instances, instances)


# --- an OpenAI-compatible HTTP server ---------------------------------------------------------------

LLAMA_SERVER_FIELDS: dict[str, Any] = {"cache_prompt": False}
"""``cache_prompt: false`` stops llama-server from reusing a slot's earlier prompt (its slots would keep all 8
prompts cached); llama_cpp.server ignores it. Elsewhere only the previous prompt's common prefix is reused, and
consecutive prompts share none but the first token."""
GATEWAY_FIELDS: dict[str, Any] = {"stream_options": {"include_usage": True}}
"""mpserve's gateway: its last event carries the usage (it gathers tokens into fewer events than tokens)."""


async def http_load(port: int, work: Workload, concurrency: int, n: int,
                    fields: dict[str, Any] | None = None) -> LoadResult:
    loop = asyncio.get_running_loop()
    extra = LLAMA_SERVER_FIELDS if fields is None else fields
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return await closed_loop(concurrency, n, work.budget_s,
                                 lambda i: loop.run_in_executor(pool, http_request, port, work, i, extra))


def http_request(port: int, work: Workload, i: int, fields: dict[str, Any]) -> Sample:
    """POST /v1/completions with stream=true and the server's own ``fields``, reading the server-sent events
    as they arrive."""
    body = json.dumps({"prompt": work.prompt(i), "max_tokens": work.max_tokens, "temperature": 0.0,
                       "repeat_penalty": 1.0, "stream": True, **fields})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    started = time.perf_counter()
    first = 0.0
    chunks = 0
    usage: int | None = None
    cached = 0
    pieces: list[str] = []
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {reply.read()[:500]!r}")
        while line := reply.readline():
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event: dict[str, Any] = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
            if timings := event.get("timings"):
                cached = timings.get("cached_tokens", timings.get("cache_n", cached))
            if any(choice.get("text") for choice in event.get("choices", ())):
                first = first or time.perf_counter()
                chunks += 1
                pieces += (choice.get("text", "") for choice in event["choices"])
    finally:
        conn.close()
    ended = time.perf_counter()
    return Sample(first - started, ended - started, usage if usage is not None else chunks, "".join(pieces), cached)


# --- llama_cpp in this process ------------------------------------------------------------------------

def direct_load(llm: Any, work: Workload, n: int) -> LoadResult:
    """``n`` requests in sequence through ``llama_cpp.Llama.create_completion``, whose greedy text mpserve's
    engine gives too (fewer if ``work.budget_s`` runs out)."""
    samples: list[Sample] = []
    started = time.perf_counter()
    for i in range(n):
        if samples and time.perf_counter() - started >= work.budget_s:
            break
        samples.append(direct_request(llm, work, i))
    return LoadResult(samples, time.perf_counter() - started)


def direct_request(llm: Any, work: Workload, i: int) -> Sample:
    started = time.perf_counter()
    first = 0.0
    tokens = 0
    for chunk in llm.create_completion(work.prompt(i), max_tokens=work.max_tokens, temperature=0.0,
                                       repeat_penalty=1.0, stream=True):
        if chunk["choices"][0]["text"]:
            first = first or time.perf_counter()
            tokens += 1
    ended = time.perf_counter()
    return Sample(first - started, ended - started, tokens)


def load_direct(model: str, work: Workload, threads: int) -> Any:
    """A ``llama_cpp.Llama`` with the context settings mpserve's engine uses, warmed up with one request."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=model, n_ctx=work.n_ctx, n_threads=threads, n_threads_batch=threads,
                          seed=0, flash_attn=True, verbose=False)  # mpserve's default, auto, is on here
    direct_request(llm, work, 0)
    return llm


_DIRECT_PROCESS = """
import json, sys, time
from bench.load import Workload, direct_request, load_direct
model, work, threads = sys.argv[1], Workload(**json.loads(sys.argv[2])), int(sys.argv[3])
llm = load_direct(model, work, threads)
print("ready", flush=True)
for line in sys.stdin:  # one run: the request indices of this process, comma-separated
    started, cpu = time.perf_counter(), time.process_time()
    tokens = 0
    for i in line.split(","):
        if tokens and time.perf_counter() - started >= work.budget_s:
            break
        tokens += direct_request(llm, work, int(i)).tokens
    print(json.dumps({"tokens": tokens, "wall_s": time.perf_counter() - started,
                      "cpu_s": time.process_time() - cpu}), flush=True)
"""


@dataclass(frozen=True)
class Direct:
    tokens_per_s: float
    cpu_s_per_token: float  # every thread of the processes, over the timed requests


class DirectProcesses:
    """``processes`` independent ``llama_cpp.Llama`` processes, each loading the model once: every ``run``
    shares ``n`` requests among them round-robin, started together (each stops after the time budget), which
    is what the machine gives several instances with no serving layer. Kept for a block, so that they are
    about as old as the server they are measured against: on the reference VM a process that had just loaded
    the model decoded faster than one that had loaded it minutes, even seconds, earlier (docs/benchmarks.md,
    "The broker")."""

    def __init__(self, model: str, work: Workload, processes: int, threads: int) -> None:
        self._procs = [subprocess.Popen([sys.executable, "-c", _DIRECT_PROCESS, model, json.dumps(vars(work)),
                                         str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                       for _ in range(processes)]

    def __enter__(self) -> DirectProcesses:
        try:
            for proc in self._procs:
                assert proc.stdout is not None
                if proc.stdout.readline().strip() != "ready":
                    raise RuntimeError("a direct llama_cpp process did not load the model")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, n: int) -> Direct:
        lanes = len(self._procs)
        for lane, proc in enumerate(self._procs):
            assert proc.stdin is not None
            proc.stdin.write(",".join(str(i) for i in range(lane, n, lanes)) + "\n")
        for proc in self._procs:
            assert proc.stdin is not None
            proc.stdin.flush()
        results = []
        for proc in self._procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"a direct llama_cpp process exited (status {proc.wait()})")
            results.append(json.loads(line))
        tokens = sum(r["tokens"] for r in results)
        return Direct(tokens / max(r["wall_s"] for r in results), sum(r["cpu_s"] for r in results) / max(1, tokens))

    def close(self) -> None:
        for proc in self._procs:
            proc.kill()
            proc.wait()
