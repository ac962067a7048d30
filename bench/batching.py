"""Batching: continuous batching through the whole server, against llama-server's, at concurrency K.

For each K, a closed loop of K lanes streams greedy requests to each contender, which take turns within a
repeat (a busy moment on the machine hits all of them):

- ``llama-server --parallel K --threads cores`` (the baseline), with flash attention on its default, auto;
- mpserve ``1×K``: one instance, threads = cores, ``--parallel K``: the configuration the targets are on;
- mpserve ``1×K over HTTP``: the same behind its OpenAI gateway (``--http``), driven by the same HTTP client
  as llama-server: the interface users of both call;
- mpserve ``1×K, a chunk per token``: the same with ``--stream-interval 0``, streaming every token as
  llama-server does, to show what gathering a request's tokens into fewer messages is worth;
- mpserve ``cores×K``: one instance per core, one thread each, ``--parallel K`` each.

Every server holds n_ctx per sequence. llama-server is asked not to reuse a slot's earlier prompt
(``cache_prompt: false``); mpserve reuses a cached prefix only when a prompt shares one, and the prompts
here share nothing but their first characters.

The long prompts of the cases below are sized in tokens of the model under test (counted by the server's
tokenizer), so that each spans the same number of 512-token chunks, the unit of reuse, on any vocabulary.

One more case needs no peer: prefix reuse. A long prompt is sent twice with different endings to an
instance with ``--parallel 2``; the second goes to the slot that holds the first one's KV cells, which
computes only what differs. Its time to first token is set against the first's (a new prefix each repeat).

Pushed out: a long prompt sent again after 8 others went through the only slot, on mpserve with its host-RAM
prompt cache (``cache_ram``) and without it, and on two instances of one slot each (the broker routes the
prompt's second sending to the instance whose cache holds it), against ``llama-server --cache-ram``: the time
to first token of the prompt's second sending, which a cache restores instead of computing.

And one with a peer: a system prompt shared by every request (a long preamble, then one of the usual
prompts) at concurrency 4, on ``1×4`` against ``llama-server --parallel 4`` with its prompt cache on
(``cache_prompt: true``, its best case: a slot reuses its own last prompt, and any prompt it has seen is
restored from host memory). mpserve computes the preamble once and copies its KV cells to other slots.

``python -m bench.batching`` runs the 1×K rows alone (ZeroMQ and over HTTP, against llama-server), and
variants of the HTTP row with other ``mpserve start`` options (``--variant 'threads-1=--threads 1'``):

    python -m bench.batching [--model GGUF] [--ks 1,2,4,8] [--repeat 3] [--variant NAME=OPTIONS ...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from mpserve import AsyncClient, Client

from .figures import Case, Figure, Section, Target
from .load import (
    GATEWAY_FIELDS,
    GENERATION_METRICS,
    PROMPTS,
    LoadResult,
    Workload,
    http_load,
    http_request,
    mpserve_load,
    mpserve_warm_up,
)
from .procs import HttpServer, MpserveServer, find_llama_server, free_port, wait_http
from .settings import Settings

KS = (1, 2, 4, 8)
SHARED_K = 4
PREAMBLE = ("You are the assistant of a small bakery. Answer questions about opening hours, bread, cakes and "
            "orders politely and briefly; never invent prices; if unsure, ask the customer to call the shop. ")
TARGET = 1.0
TARGET_AT_8 = 1.2
PEER_RAM = 256  # MiB: llama-server's --cache-ram, as mpserve's default cache_ram
PER_TOKEN = "--stream-interval 0"
OVER_HTTP = "over HTTP"


def run(settings: Settings) -> Section:
    section = Section("batching", "Batching: mpserve --parallel K against llama-server --parallel K",
                      "llama-server --parallel K, same threads, same GGUF (column vs)")
    section.cases.append(_prefix_reuse(settings, section))
    if settings.llama_server is None:
        section.notes.append("llama-server rows left out: no llama-server binary; put one on PATH or pass "
                             "--llama-server (bench/README.md says how to build it from the llama-cpp-python source "
                             "archive)")
        return section
    cores = settings.cores
    work = Workload(max_tokens=settings.pick(8, 64), n_ctx=settings.work.n_ctx, min_requests=1,
                    budget_s=settings.work.budget_s)
    ks = (2,) if settings.quick else KS
    for k in ks:
        one = ["--instances", "1", "--threads", str(cores), "--parallel", str(k)]
        contenders = {f"1×{k}": one, f"1×{k} {OVER_HTTP}": [*one, "--http", f"127.0.0.1:{free_port()}"],
                      f"1×{k}, a chunk per token": [*one, *PER_TOKEN.split()],
                      f"{cores}×{k}, 1 thread each": ["--instances", str(cores), "--threads", "1", "--parallel",
                                                      str(k)]}
        cases = {name: Case({"mpserve instances×slots": name, "vs": f"llama-server --parallel {k}",
                             "concurrency": str(k)}, [Figure(m, unit) for m, unit, _ in GENERATION_METRICS])
                 for name in contenders}
        _measure(settings, work, k, contenders, cases)
        section.cases += cases.values()
        threshold = TARGET_AT_8 if k == 8 else TARGET
        for name, interface in ((f"1×{k}", "ZeroMQ client"), (f"1×{k} {OVER_HTTP}", "HTTP, both sides")):
            section.targets.append(Target(
                f"batching {name} tokens/s vs llama-server --parallel {k} at concurrency {k} ({interface}): "
                f"≥ {threshold}×", cases[name].figure("tokens/s").ratio, ">=", threshold))
    section.cases.append(_shared_preamble(settings, section))
    ram = _pushed_out(settings, section)
    section.cases += ram
    section.targets.append(Target("TTFT of a long prompt pushed out of the slot by 8 others, mpserve with its "
                                  "prompt cache vs llama-server --cache-ram: ≤ 1.0×", ram[0].figures[0].ratio, "<=",
                                  1.0))
    section.targets.append(Target("the same with 2 instances, the prompt routed back to the one whose cache holds it: "
                                  "≤ 1.0×", ram[2].figures[0].ratio, "<=", 1.0))
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
        gateways = {name: int(args[args.index("--http") + 1].rsplit(":", 1)[1])
                    for name, args in contenders.items() if "--http" in args}
        peer.wait_ready()
        asyncio.run(http_load(port, work, k, k))
        for name, server in ours.items():
            server.wait_ready()
            if name in gateways:
                if not wait_http(f"http://127.0.0.1:{gateways[name]}/health"):
                    raise RuntimeError(f"mpserve's gateway for {name} did not answer on port {gateways[name]}")
                asyncio.run(http_load(gateways[name], work, k, k, GATEWAY_FIELDS))
            else:
                asyncio.run(mpserve_warm_up(server.address, work, k))
        n = 3 * k
        for _ in range(settings.repeat):
            baseline = asyncio.run(http_load(port, work, k, n))
            for name, server in ours.items():
                load = http_load(gateways[name], work, k, n, GATEWAY_FIELDS) if name in gateways else \
                    mpserve_load(server.address, work, k, n)
                _add(cases[name], asyncio.run(load), baseline)


def _shared_preamble(settings: Settings, section: Section) -> Case:
    """Concurrency SHARED_K, every prompt starting with the same long preamble; llama-server's prompt cache on."""
    k = SHARED_K
    work = Workload(max_tokens=settings.pick(4, 16), n_ctx=2048, min_requests=1, budget_s=settings.work.budget_s)
    preamble_tokens = settings.pick(192, 1000)
    case = Case({"mpserve instances×slots": f"1×{k}, shared preamble",
                 "vs": f"llama-server --parallel {k}, prompt cache on", "concurrency": str(k)},
                [Figure(m, unit) for m, unit, _ in GENERATION_METRICS])
    port = free_port()
    with HttpServer([str(settings.llama_server), "--model", str(settings.model), "--host", "127.0.0.1", "--port",
                     str(port), "--threads", str(settings.cores), "--threads-batch", str(settings.cores),
                     "--parallel", str(k), "--ctx-size", str(work.n_ctx * k)], port, "/health") as peer, \
            MpserveServer("--model", str(settings.model), "--n-ctx", str(work.n_ctx), "--instances", "1",
                          "--threads", str(settings.cores), "--parallel", str(k)) as ours:
        peer.wait_ready()
        ours.wait_ready()
        work = Workload(**{**vars(work), "preamble": _tokens_long(ours.address, PREAMBLE, preamble_tokens)})
        for r in range(settings.repeat):  # each repeat starts cold on both sides: a new preamble
            fresh = Workload(**{**vars(work), "preamble": f"[{r}] {work.preamble}"})
            _add(case, asyncio.run(mpserve_load(ours.address, fresh, k, 3 * k)),
                 asyncio.run(http_load(port, fresh, k, 3 * k, {"cache_prompt": True})))
    section.notes.append(f"Shared preamble: every prompt starts with the same preamble of {preamble_tokens} tokens "
                         f"({len(work.preamble)} characters; a new one each repeat, so each starts cold), then one of "
                         f"the usual prompts; {work.max_tokens} tokens generated, 3 requests per lane, n_ctx "
                         f"{work.n_ctx}; llama-server with cache_prompt true.")
    return case


def _prefix_reuse(settings: Settings, section: Section) -> Case:
    """Time to first token of a long prompt sent again with another ending, against its first time."""
    length = settings.pick(640, 1500)  # tokens of the model under test
    case = Case({"mpserve instances×slots": "1×2", "vs": "the same long prompt the first time",
                 "concurrency": "1"}, [Figure("TTFT", "ms")], plotted=False)
    reused: list[tuple[int, int]] = []  # (cached, prompt) tokens of the second request
    with MpserveServer("--model", str(settings.model), "--n-ctx", "2048", "--instances", "1", "--threads",
                       str(settings.cores), "--parallel", "2") as server:
        server.wait_ready()
        for r in range(settings.repeat):
            prefix = _tokens_long(server.address, f"Repeat {r}. " + " ".join(PROMPTS[r % len(PROMPTS):] + PROMPTS),
                                  length)
            first, _ = asyncio.run(_ttft(server.address, prefix + " First question?"))
            again, tokens = asyncio.run(_ttft(server.address, prefix + " Second question?"))
            case.figures[0].add(again * 1000, first * 1000)
            reused.append(tokens)
    section.notes.append("Prefix reuse: the second prompt shares all but its ending with the first; per repeat, "
                         + ", ".join(f"{c} of its {n} tokens" for c, n in reused) + " came from the slot's cache "
                         "(timings.cached_tokens) instead of being computed. 8 tokens generated each.")
    return case


def _pushed_out(settings: Settings, section: Section) -> list[Case]:
    """TTFT of a long prompt sent again, with another ending, after 8 other prompts took the only slot: mpserve
    with its host-RAM prompt cache and without it, and with two instances (the broker routes the prompt back to
    the one holding it), against llama-server with its ``--cache-ram``."""
    length = settings.pick(640, 1000)  # tokens of the model under test
    variants = (("1", "256MiB"), ("1", "0"), ("2", "256MiB"))
    cases = [Case({"mpserve instances×slots": f"{n}×1, cache_ram {size}", "vs": f"llama-server --cache-ram {PEER_RAM}",
                   "concurrency": "1"}, [Figure("TTFT", "ms")], plotted=False) for n, size in variants]
    port = free_port()
    common = ["--model", str(settings.model), "--n-ctx", "2048", "--threads", str(settings.cores)]
    restored: dict[str, list[int]] = {case.labels["mpserve instances×slots"]: [] for case in cases}
    with ExitStack() as stack:
        peer = stack.enter_context(HttpServer(
            [str(settings.llama_server), "--model", str(settings.model), "--host", "127.0.0.1", "--port", str(port),
             "--threads", str(settings.cores), "--threads-batch", str(settings.cores), "--parallel", "1",
             "--ctx-size", "2048", "--cache-ram", str(PEER_RAM)], port, "/health"))
        servers = [stack.enter_context(MpserveServer(*common, "--instances", n, "--cache-ram", size))
                   for n, size in variants]
        peer.wait_ready()
        for server in servers:
            server.wait_ready()
        for r in range(settings.repeat):
            prompt = _tokens_long(servers[0].address, f"Repeat {r}. " + " ".join(PROMPTS[r % len(PROMPTS):] + PROMPTS),
                                  length)
            others = [f"Other {r}.{i}. " + " ".join(PROMPTS[i % len(PROMPTS):] + PROMPTS) for i in range(8)]
            again = _once(prompt + " Second question? ")
            for text in (prompt, *others):
                http_request(port, _once(text), 0, {"cache_prompt": True})
            peer_s = http_request(port, again, 0, {"cache_prompt": True}).ttft_s
            for case, server in zip(cases, servers, strict=True):
                for text in (prompt, *others):
                    asyncio.run(_ttft(server.address, _once(text).prompt(0)))
                seconds, (reused, _) = asyncio.run(_ttft(server.address, again.prompt(0)))
                case.figures[0].add(seconds * 1000, peer_s * 1000)
                restored[case.labels["mpserve instances×slots"]].append(reused)
    section.notes.append(f"Pushed out: a prompt of {length} tokens, then 8 others through the only slot (of each "
                         "instance), then the first again with another ending; tokens mpserve restored or reused per "
                         "repeat (timings.cached_tokens): " + "; ".join(f"{name}: {', '.join(map(str, counts))}"
                                                                       for name, counts in restored.items())
                         + ". With 2 instances (one computing at a time, each with every core) the prompts alternate "
                         "between them, and the broker sends the first one back to the instance whose prompt cache "
                         "holds it. "
                         "llama-server with cache_prompt true. 8 tokens generated each.")
    return cases


def _tokens_long(address: str, text: str, tokens: int) -> str:
    """The shortest repetition of ``text``, cut at a character, that is ``tokens`` tokens or more in the model
    the server at ``address`` serves (so the case is the same size on any vocabulary)."""
    with Client(address) as client:
        def count(candidate: str) -> int:
            return len(client.tokenize(candidate).tokens)

        while count(text) < tokens:
            text += " " + text
        lo, hi = 1, len(text)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if count(text[:mid]) < tokens else (lo, mid)
        return text[:lo]


def _once(text: str) -> Workload:
    """A workload whose request 0 is ``text`` and a short prompt after it, 8 tokens."""
    return Workload(max_tokens=8, n_ctx=2048, min_requests=1, budget_s=60.0, preamble=text)


async def _ttft(address: str, prompt: str) -> tuple[float, tuple[int, int]]:
    """Seconds to the first streamed token; the prompt tokens the worker reused, and the prompt's tokens."""
    async with AsyncClient(address) as client:
        stream = client.stream(prompt, max_tokens=8, temperature=0.0)
        started = time.perf_counter()
        first = 0.0
        async for _ in stream:
            first = first or time.perf_counter()
        assert stream.result is not None
        result = stream.result
        return first - started, (result.timings.cached_tokens, result.usage.prompt_tokens)


def _add(case: Case, served: LoadResult, peer: LoadResult) -> None:
    for figure, (_, _, read) in zip(case.figures, GENERATION_METRICS, strict=True):
        figure.add(read(served), read(peer))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.batching", description="the 1×K rows of the batching "
                                     "section alone: mpserve over ZeroMQ and over HTTP against llama-server")
    parser.add_argument("--model", type=Path, help="GGUF file [default: the built-in bench model]")
    parser.add_argument("--ks", default=",".join(map(str, KS)), help="concurrencies [default: %(default)s]")
    parser.add_argument("--repeat", type=int, default=3, help="repeats [default: %(default)s]")
    parser.add_argument("--llama-server", help="llama-server binary [default: on PATH, else /opt/llama-server*/]")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=OPTIONS",
                        help="one more HTTP row with these `mpserve start` options (may be repeated)")
    args = parser.parse_args()
    from mpserve.models.builtin import builtin_model_path

    settings = Settings.make(quick=False, repeat=args.repeat, model=args.model or builtin_model_path("bench"),
                             llama_server=find_llama_server(args.llama_server))
    if settings.llama_server is None:
        parser.error("no llama-server binary: put one on PATH or pass --llama-server")
    variants = dict(v.split("=", 1) for v in args.variant)
    work = Workload(max_tokens=64, n_ctx=settings.work.n_ctx, min_requests=1, budget_s=settings.work.budget_s)
    print(f"{settings.model.name}, {settings.cores} cores, {args.repeat} repeats, {work.max_tokens} tokens per "
          "request; ratio to llama-server: median [min–max over repeats]")
    with tempfile.TemporaryDirectory(prefix="mpb-", dir="/tmp") as runtime:
        os.environ["MPSERVE_RUNTIME_DIR"] = runtime
        for k in map(int, args.ks.split(",")):
            one = ["--instances", "1", "--threads", str(settings.cores), "--parallel", str(k)]
            contenders = {f"1×{k}": one, f"1×{k} {OVER_HTTP}": [*one, "--http", f"127.0.0.1:{free_port()}"]}
            contenders |= {f"1×{k} {OVER_HTTP}, {name}": [*one, *shlex.split(options), "--http",
                                                          f"127.0.0.1:{free_port()}"]
                           for name, options in variants.items()}
            cases = {name: Case({}, [Figure(m, unit) for m, unit, _ in GENERATION_METRICS]) for name in contenders}
            _measure(settings, work, k, contenders, cases)
            for name, case in cases.items():
                print(f"{name:>40}: " + "; ".join(_ratio(case.figure(m)) for m in ("tokens/s", "TTFT p50")),
                      flush=True)


def _ratio(figure: Figure) -> str:
    ratios = [v / b for v, b in zip(figure.values, figure.baseline, strict=True) if b]
    return (f"{figure.metric} {figure.value:.1f} vs {figure.base:.1f} {figure.unit}, "
            f"{figure.ratio:.2f}× [{min(ratios):.2f}–{max(ratios):.2f}]")


if __name__ == "__main__":
    main()
