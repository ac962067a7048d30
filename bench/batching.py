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

Pushed out: a long prompt sent again after 8 others went through the only slot, on mpserve with its host store
(``cache_ram``) and without it, and on two instances of one slot each (either restores it from the host store),
against ``llama-server --cache-ram``: the time to first token of the prompt's second sending, which a cache
restores instead of computing. Each server has a store of its own (``--cache-shm``).

The host store's own cases (4 instances serving many tenants' system prompts, and a single-active-backend swap
A → B → A) are in ``bench.store_cases``; they need no peer. ``python -m bench.cache_ram`` runs pushed out, the
shared preamble and the chat below against ``llama-server --cache-ram`` over HTTP on both sides.

And one with a peer: a system prompt shared by every request (a long preamble, then one of the usual
prompts) at concurrency 4, on ``1×4`` against ``llama-server --parallel 4`` with its prompt cache on
(``cache_prompt: true``, its best case: a slot reuses its own last prompt, and any prompt it has seen is
restored from host memory). mpserve computes the preamble once and copies its KV cells to other slots; it
runs in both reuse modes (``any``, the default, reuses the whole common prefix; ``exact`` whole 512-token
chunks only).

A chat: 8 turns, each prompt the conversation so far (every earlier question and the server's own reply)
and a new question, growing to about 3,000 tokens, against ``llama-server --parallel 1 --cache-ram``: the
time to first token of every turn, in both reuse modes (``any`` reuses the last reply's cells; ``exact``
computes everything after the last whole chunk again).

llama-server loads its weights without repacking (``--no-repack``) where mpserve's probe finds this CPU's
repacked kernels crash, as mpserve then does itself.

``python -m bench.batching`` runs the 1×K rows alone (ZeroMQ and over HTTP, against llama-server), and
variants of the HTTP row with other ``mpserve start`` options (``--variant 'threads-1=--threads 1'``); a variant
given with ``--pinned`` instead has its worker's threads pinned to the first CPU this bench may use and the
serving processes (the server's broker, its gateway, the zygote) to the others, once it is ready:

    python -m bench.batching [--model GGUF|SmolLM2|Gemma] [--ks 1,2,4,8] [--repeat 3] [--variant NAME=OPTIONS ...]
                             [--pinned NAME=OPTIONS ...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import tempfile
import time
from contextlib import ExitStack

from mpserve import AsyncClient, Client
from mpserve.config.settings import BY_KEY
from mpserve.repack import probe

from . import real_models, store_cases
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
from .procs import HttpServer, MpserveServer, find_llama_server, free_port, pin_spare_core, wait_http
from .settings import Settings

KS = (1, 2, 4, 8)
SHARED_K = 4
PREAMBLE = ("You are the assistant of a small bakery. Answer questions about opening hours, bread, cakes and "
            "orders politely and briefly; never invent prices; if unsure, ask the customer to call the shop. ")
TARGET = 1.0
TARGET_AT_8 = 1.2
PEER_RAM = 256  # MiB: llama-server's --cache-ram, as mpserve's default cache_ram
SHARED_TARGETS = (("tokens/s", ">=", 1.5), ("TTFT p50", "<=", 1.0))  # reuse any vs llama-server, shared preamble
REUSE_MODES = BY_KEY["reuse"].choices or ()
CHAT_TURNS = 8
CHAT_QUESTION_TOKENS = 330  # tokens of each turn's question: 8 turns with their replies make about 3,000
CHAT_REPLY_TOKENS = 32
PER_TOKEN = "--stream-interval 0"
OVER_HTTP = "over HTTP"


def run(settings: Settings) -> Section:
    section = Section("batching", "Batching: mpserve --parallel K against llama-server --parallel K",
                      "llama-server --parallel K, same threads, same GGUF (column vs)")
    section.cases.append(_prefix_reuse(settings, section))
    section.cases.append(store_cases.tenants(settings, section, tokens_long))
    section.cases.append(store_cases.swap(settings, section, tokens_long))
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
    section.cases += _shared_preamble(settings, section)
    section.cases += _chat(settings, section)
    ram = _pushed_out(settings, section)
    section.cases += ram
    section.targets.append(Target("TTFT of a long prompt pushed out of the slot by 8 others, mpserve with its "
                                  "prompt cache vs llama-server --cache-ram: ≤ 1.0×", ram[0].figures[0].ratio, "<=",
                                  1.0))
    section.targets.append(Target("the same with 2 instances sharing the host store: ≤ 1.0×", ram[2].figures[0].ratio,
                                  "<=", 1.0))
    section.notes.append(
        f"Greedy, {work.max_tokens} tokens per request, streamed, {work.n_ctx} tokens of context per sequence, "
        "3 requests per lane, contenders taking turns within each repeat. mpserve streams a request's first token "
        "at once and gathers later ones into a chunk at most every 20 ms (its default stream_interval); the rows "
        f"'a chunk per token' ({PER_TOKEN}) send a message per token, as llama-server sends a server-sent event "
        "per token. Flash attention: auto on both sides (on, on a CPU).")
    return section


def llama_server(settings: Settings, port: int, parallel: int, n_ctx: int, *extra: str) -> HttpServer:
    """llama-server on ``port`` with mpserve's threads, ``parallel`` slots of ``n_ctx`` tokens each."""
    repack = [] if probe().works else ["--no-repack"]  # its repacked kernels crash on this CPU: as mpserve does
    return HttpServer([str(settings.llama_server), "--model", str(settings.model), "--host", "127.0.0.1", "--port",
                       str(port), "--threads", str(settings.cores), "--threads-batch", str(settings.cores),
                       "--parallel", str(parallel), "--ctx-size", str(n_ctx * parallel), *repack, *extra],
                      port, "/health")


def _measure(settings: Settings, work: Workload, k: int, contenders: dict[str, list[str]],
             cases: dict[str, Case], pinned: frozenset[str] = frozenset()) -> None:
    with ExitStack() as stack:
        port = free_port()
        peer = stack.enter_context(llama_server(settings, port, k, work.n_ctx))
        ours = {name: stack.enter_context(MpserveServer("--model", str(settings.model), "--n-ctx", str(work.n_ctx),
                                                        *args))
                for name, args in contenders.items()}
        gateways = {name: int(args[args.index("--http") + 1].rsplit(":", 1)[1])
                    for name, args in contenders.items() if "--http" in args}
        peer.wait_ready()
        asyncio.run(http_load(port, work, k, k))
        for name, server in ours.items():
            server.wait_ready()
            if name in pinned:
                pin_spare_core(server)
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


def _shared_preamble(settings: Settings, section: Section) -> list[Case]:
    """Concurrency SHARED_K, every prompt starting with the same long preamble, mpserve in each reuse mode;
    llama-server's prompt cache on."""
    k = SHARED_K
    work = Workload(max_tokens=settings.pick(4, 16), n_ctx=2048, min_requests=1, budget_s=settings.work.budget_s)
    preamble_tokens = settings.pick(192, 1000)
    cases = {mode: Case({"mpserve instances×slots": f"1×{k}, shared preamble, reuse {mode}",
                         "vs": f"llama-server --parallel {k}, prompt cache on", "concurrency": str(k)},
                        [Figure(m, unit) for m, unit, _ in GENERATION_METRICS]) for mode in REUSE_MODES}
    port = free_port()
    with ExitStack() as stack:
        peer = stack.enter_context(llama_server(settings, port, k, work.n_ctx))
        ours = {mode: stack.enter_context(MpserveServer(
            "--model", str(settings.model), "--n-ctx", str(work.n_ctx), "--instances", "1", "--threads",
            str(settings.cores), "--parallel", str(k), "--reuse", mode)) for mode in REUSE_MODES}
        peer.wait_ready()
        for server in ours.values():
            server.wait_ready()
        work = Workload(**{**vars(work), "preamble": tokens_long(ours["any"].address, PREAMBLE, preamble_tokens)})
        for r in range(settings.repeat):  # each repeat starts cold on every side: a new preamble
            fresh = Workload(**{**vars(work), "preamble": f"[{r}] {work.preamble}"})
            baseline = asyncio.run(http_load(port, fresh, k, 3 * k, {"cache_prompt": True}))
            for mode, server in ours.items():
                _add(cases[mode], asyncio.run(mpserve_load(server.address, fresh, k, 3 * k)), baseline)
    for metric, op, threshold in SHARED_TARGETS:
        section.targets.append(Target(
            f"shared {preamble_tokens}-token preamble at concurrency {k}, reuse any: {metric} vs llama-server "
            f"--parallel {k} with its prompt cache {'≥' if op == '>=' else '≤'} {threshold}×",
            cases["any"].figure(metric).ratio, op, threshold))
    section.notes.append(f"Shared preamble: every prompt starts with the same preamble of {preamble_tokens} tokens "
                         f"({len(work.preamble)} characters; a new one each repeat, so each starts cold), then one of "
                         f"the usual prompts; {work.max_tokens} tokens generated, 3 requests per lane, n_ctx "
                         f"{work.n_ctx}; llama-server with cache_prompt true, measured once per repeat, before the "
                         "mpserve servers.")
    return list(cases.values())


def _chat(settings: Settings, section: Section) -> list[Case]:
    """A conversation of CHAT_TURNS turns, each prompt the whole conversation so far with the server's own
    replies: time to first token per turn, mpserve in each reuse mode against llama-server --cache-ram."""
    turns = settings.pick(3, CHAT_TURNS)
    question_tokens = settings.pick(120, CHAT_QUESTION_TOKENS)
    n_ctx = 4096
    cases = {mode: Case({"mpserve instances×slots": f"1×1, chat, reuse {mode}",
                         "vs": f"llama-server --parallel 1 --cache-ram {PEER_RAM}", "concurrency": "1"},
                        [Figure(f"TTFT turn {t + 1}", "ms") for t in range(turns)], plotted=False)
             for mode in REUSE_MODES}
    reused: dict[str, list[int]] = {mode: [] for mode in REUSE_MODES}
    lengths: list[int] = []
    port = free_port()
    with ExitStack() as stack:
        peer = stack.enter_context(llama_server(settings, port, 1, n_ctx, "--cache-ram", str(PEER_RAM)))
        ours = {mode: stack.enter_context(MpserveServer(
            "--model", str(settings.model), "--n-ctx", str(n_ctx), "--instances", "1", "--threads",
            str(settings.cores), "--parallel", "1", "--reuse", mode)) for mode in REUSE_MODES}
        peer.wait_ready()
        for server in ours.values():
            server.wait_ready()
        address = ours["any"].address
        for r in range(settings.repeat):
            questions = [tokens_long(address, f"Chat {r}, question {t + 1}: " + " ".join(
                PROMPTS[(r + t) % len(PROMPTS):] + PROMPTS), question_tokens) for t in range(turns)]
            talks = {side: "" for side in ("peer", *REUSE_MODES)}  # each side's conversation, its own replies
            for t, question in enumerate(questions):
                talks["peer"] += f"\nUser: {question}\nAssistant:"
                sample = http_request(port, _chat_turn(talks["peer"]), 0, {"cache_prompt": True})
                talks["peer"] += sample.text
                for mode, server in ours.items():
                    talks[mode] += f"\nUser: {question}\nAssistant:"
                    seconds, text, (cached, prompt_tokens) = asyncio.run(_reply(server.address, talks[mode],
                                                                                       CHAT_REPLY_TOKENS))
                    talks[mode] += text
                    cases[mode].figures[t].add(seconds * 1000, sample.ttft_s * 1000)
                    reused[mode].append(cached)
                    if mode == "any" and r == 0:
                        lengths.append(prompt_tokens)
    for t in range(turns):
        section.targets.append(Target(
            f"chat turn {t + 1} of {turns}, reuse any: TTFT vs llama-server --cache-ram ≤ 1.0×",
            cases["any"].figures[t].ratio, "<=", 1.0))
    section.notes.append(f"Chat: {turns} turns, each a question of {question_tokens} tokens and a reply of up to "
                         f"{CHAT_REPLY_TOKENS} tokens (greedy), each prompt the conversation so far with the side's "
                         f"own replies; prompt tokens per turn (reuse any, first repeat): "
                         f"{', '.join(map(str, lengths))}; tokens reused per turn (timings.cached_tokens), all "
                         "repeats: " + "; ".join(f"{mode}: {', '.join(map(str, n))}" for mode, n in reused.items())
                         + ". llama-server with cache_prompt true.")
    return list(cases.values())


def _chat_turn(conversation: str) -> Workload:
    """The workload whose request 0 is ``conversation`` as it is, a chat reply long."""
    return Workload(max_tokens=CHAT_REPLY_TOKENS, n_ctx=4096, min_requests=1, budget_s=60.0, preamble=conversation,
                    ending=False)


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
            prefix = tokens_long(server.address, f"Repeat {r}. " + " ".join(PROMPTS[r % len(PROMPTS):] + PROMPTS),
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
    variants = (("1", "256MiB", "any"), ("1", "0", "any"), ("2", "256MiB", "any"), ("1", "256MiB", "exact"))
    cases = [Case({"mpserve instances×slots": f"{n}×1, cache_ram {size}, reuse {mode}",
                   "vs": f"llama-server --cache-ram {PEER_RAM}", "concurrency": "1"}, [Figure("TTFT", "ms")],
                  plotted=False) for n, size, mode in variants]
    port = free_port()
    common = ["--model", str(settings.model), "--n-ctx", "2048", "--threads", str(settings.cores)]
    restored: dict[str, list[int]] = {case.labels["mpserve instances×slots"]: [] for case in cases}
    with ExitStack() as stack:
        stores = stack.enter_context(tempfile.TemporaryDirectory(prefix="mppush-"))
        peer = stack.enter_context(llama_server(settings, port, 1, 2048, "--cache-ram", str(PEER_RAM)))
        servers = [stack.enter_context(MpserveServer(*common, "--instances", n, "--cache-ram", size, "--reuse", mode,
                                                     "--cache-shm", f"{stores}/{i}"))
                   for i, (n, size, mode) in enumerate(variants)]
        peer.wait_ready()
        for server in servers:
            server.wait_ready()
        for r in range(settings.repeat):
            prompt = tokens_long(servers[0].address, f"Repeat {r}. " + " ".join(PROMPTS[r % len(PROMPTS):] + PROMPTS),
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
                         "between them, and either restores the first one from the host store. "
                         "llama-server with cache_prompt true. 8 tokens generated each.")
    return cases


def tokens_long(address: str, text: str, tokens: int, model: str | None = None) -> str:
    """The shortest repetition of ``text``, cut at a character, that is ``tokens`` tokens or more in the model
    the server at ``address`` serves (``model``, if it serves several), so the case is the same size on any
    vocabulary."""
    with Client(address, timeout=600) as client:
        def count(candidate: str) -> int:
            return len(client.tokenize(candidate, model=model).tokens)

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
    seconds, _, tokens = await _reply(address, prompt, 8)
    return seconds, tokens


async def _reply(address: str, prompt: str, max_tokens: int) -> tuple[float, str, tuple[int, int]]:
    """Seconds to the first streamed token of a greedy reply to ``prompt``; its text; the prompt tokens the worker
    reused, and the prompt's tokens."""
    async with AsyncClient(address) as client:
        stream = client.stream(prompt, max_tokens=max_tokens, temperature=0.0)
        started = time.perf_counter()
        first = 0.0
        async for _ in stream:
            first = first or time.perf_counter()
        assert stream.result is not None
        result = stream.result
        return first - started, result.text, (result.timings.cached_tokens, result.usage.prompt_tokens)


def _add(case: Case, served: LoadResult, peer: LoadResult) -> None:
    for figure, (_, _, read) in zip(case.figures, GENERATION_METRICS, strict=True):
        figure.add(read(served), read(peer))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.batching", description="the 1×K rows of the batching "
                                     "section alone: mpserve over ZeroMQ and over HTTP against llama-server")
    parser.add_argument("--model", help=f"GGUF file, or {' or '.join(real_models.NAMES)} (the real extra's) "
                        "[default: the built-in bench model]")
    parser.add_argument("--ks", default=",".join(map(str, KS)), help="concurrencies [default: %(default)s]")
    parser.add_argument("--repeat", type=int, default=3, help="repeats [default: %(default)s]")
    parser.add_argument("--llama-server", help="llama-server binary [default: on PATH, else /opt/llama-server*/]")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=OPTIONS",
                        help="one more HTTP row with these `mpserve start` options (may be repeated)")
    parser.add_argument("--pinned", action="append", default=[], metavar="NAME=OPTIONS",
                        help="the same, the worker's threads pinned to one CPU and the serving processes to the "
                        "others (may be repeated)")
    args = parser.parse_args()
    from mpserve.models.builtin import builtin_model_path

    try:
        model = real_models.model_path(args.model) if args.model else builtin_model_path("bench")
    except LookupError as e:
        parser.error(str(e))
    settings = Settings.make(quick=False, repeat=args.repeat, model=model,
                             llama_server=find_llama_server(args.llama_server))
    if settings.llama_server is None:
        parser.error("no llama-server binary: put one on PATH or pass --llama-server")
    variants, pinned = (dict(v.split("=", 1) for v in given) for given in (args.variant, args.pinned))
    work = Workload(max_tokens=64, n_ctx=settings.work.n_ctx, min_requests=1, budget_s=settings.work.budget_s)
    print(f"{settings.model.name}, {settings.cores} cores, {args.repeat} repeats, {work.max_tokens} tokens per "
          "request; ratio to llama-server: median [min–max over repeats]")
    with tempfile.TemporaryDirectory(prefix="mpb-", dir="/tmp") as runtime:
        os.environ["MPSERVE_RUNTIME_DIR"] = runtime
        for k in map(int, args.ks.split(",")):
            one = ["--instances", "1", "--threads", str(settings.cores), "--parallel", str(k)]
            row = f"1×{k} {OVER_HTTP}"
            contenders = {f"1×{k}": one, row: [*one, "--http", f"127.0.0.1:{free_port()}"]}
            contenders |= {f"{row}, {name}": [*one, *shlex.split(options), "--http", f"127.0.0.1:{free_port()}"]
                           for name, options in (variants | pinned).items()}
            cases = {name: Case({}, [Figure(m, unit) for m, unit, _ in GENERATION_METRICS]) for name in contenders}
            _measure(settings, work, k, contenders, cases, frozenset(f"{row}, {name}" for name in pinned))
            for name, case in cases.items():
                print(f"{name:>40}: " + "; ".join(ratio_line(case.figure(m)) for m in ("tokens/s", "TTFT p50")),
                      flush=True)


def ratio_line(figure: Figure) -> str:
    ratios = [v / b for v, b in zip(figure.values, figure.baseline, strict=True) if b]
    return (f"{figure.metric} {figure.value:.1f} vs {figure.base:.1f} {figure.unit}, "
            f"{figure.ratio:.2f}× [{min(ratios):.2f}–{max(ratios):.2f}]")


if __name__ == "__main__":
    main()
