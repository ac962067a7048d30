"""mpserve's host store against ``llama-server --cache-ram``, HTTP on both sides: prompts a server has seen before.

    pushed out ─▶ a long prompt, then 8 others through the only slot, then the first again with another ending:
                  its time to first token (a cache restores the prompt instead of computing it)
    preamble   ─▶ a long preamble shared by every request, 4 at a time on 4 slots (a new preamble each repeat):
                  the median time to first token of 12 requests
    chat       ─▶ 8 turns on one slot, each prompt the conversation so far with the side's own replies and a new
                  question: the time to first token of every turn

mpserve runs through its OpenAI gateway (``--http``) with a host store of its own (``--cache-shm``, PEER_RAM MiB,
``--reuse`` as asked), llama-server through its HTTP with ``--cache-ram`` PEER_RAM and ``cache_prompt: true``;
one HTTP client, the same threads, n_ctx per slot, GGUF and greedy requests on both; ``--no-repack`` for
llama-server where mpserve's probe finds the repacked kernels crash. Within a repeat the sides take turns, the
first side alternating between repeats. Each figure is printed as mpserve against llama-server: the medians over
the repeats, the median ratio and its range, and the prompt tokens each side reused per repeat (mpserve's
timings.cached_tokens, llama-server's timings.cache_n).

    python -m bench.cache_ram [--model GGUF] [--repeat 3] [--cases pushed,preamble,chat] [--reuse any]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from .batching import (
    CHAT_QUESTION_TOKENS,
    CHAT_REPLY_TOKENS,
    CHAT_TURNS,
    PEER_RAM,
    PREAMBLE,
    SHARED_K,
    llama_server,
    ratio_line,
    tokens_long,
)
from .figures import Figure
from .load import GATEWAY_FIELDS, PROMPTS, Workload, http_load, http_request
from .procs import MpserveServer, find_llama_server, free_port, wait_http
from .settings import Settings

CASES = ("pushed", "preamble", "chat")
PUSHED_TOKENS = 1000  # the pushed-out prompt's tokens, of the model under test
PREAMBLE_TOKENS = 1000
PEER_FIELDS: dict[str, Any] = {"cache_prompt": True}


class Sides:
    """The two servers of a case: the HTTP port and the request fields of each."""

    def __init__(self, ours: int, theirs: int, address: str) -> None:
        self.ports = {"mpserve": ours, "llama-server": theirs}
        self.fields = {"mpserve": GATEWAY_FIELDS, "llama-server": PEER_FIELDS}
        self.address = address  # mpserve's ZeroMQ front, to count tokens

    def order(self, repeat: int) -> list[str]:
        """Who goes first alternates between repeats."""
        names = list(self.ports)
        return names if repeat % 2 == 0 else names[::-1]


@contextmanager
def sides(settings: Settings, stores: str, parallel: int, n_ctx: int, reuse: str) -> Iterator[Sides]:
    """mpserve (its gateway, a store of its own) and llama-server, ``parallel`` slots of ``n_ctx`` each, ready."""
    ours, theirs = free_port(), free_port()
    with ExitStack() as stack:
        peer = stack.enter_context(llama_server(settings, theirs, parallel, n_ctx, "--cache-ram", str(PEER_RAM)))
        server = stack.enter_context(MpserveServer(
            "--model", str(settings.model), "--n-ctx", str(n_ctx), "--instances", "1", "--threads",
            str(settings.cores), "--parallel", str(parallel), "--reuse", reuse, "--cache-ram", f"{PEER_RAM}MiB",
            "--cache-shm", tempfile.mkdtemp(dir=stores), "--http", f"127.0.0.1:{ours}"))
        peer.wait_ready()
        server.wait_ready()
        if not wait_http(f"http://127.0.0.1:{ours}/health"):
            raise RuntimeError(f"mpserve's gateway did not answer on port {ours}")
        yield Sides(ours, theirs, server.address)


def pushed(settings: Settings, stores: str, reuse: str) -> tuple[list[Figure], str]:
    figure = Figure("TTFT", "ms")
    reused: dict[str, list[int]] = {"mpserve": [], "llama-server": []}
    with sides(settings, stores, 1, 2048, reuse) as both:
        for r in range(settings.repeat):
            prompt = tokens_long(both.address, f"Repeat {r}. " + " ".join(PROMPTS[r % len(PROMPTS):] + PROMPTS),
                                 PUSHED_TOKENS)
            others = [f"Other {r}.{i}. " + " ".join(PROMPTS[i % len(PROMPTS):] + PROMPTS) for i in range(8)]
            ttft: dict[str, float] = {}
            for side in both.order(r):
                for text in (prompt, *others):
                    http_request(both.ports[side], _once(text), 0, both.fields[side])
                again = http_request(both.ports[side], _once(prompt + " Second question? "), 0, both.fields[side])
                ttft[side] = again.ttft_s * 1000
                reused[side].append(again.cached)
            figure.add(ttft["mpserve"], ttft["llama-server"])
    return [figure], f"pushed out, a {PUSHED_TOKENS}-token prompt after 8 others; reused {_counts(reused)}"


def preamble(settings: Settings, stores: str, reuse: str) -> tuple[list[Figure], str]:
    k = SHARED_K
    figures = [Figure("TTFT p50", "ms"), Figure("tokens/s", "tok/s")]
    reads: list[Callable[[Any], float]] = [lambda result: result.ttft_ms(50), lambda result: result.tokens_per_s]
    reused: dict[str, list[int]] = {"mpserve": [], "llama-server": []}
    with sides(settings, stores, k, 2048, reuse) as both:
        text = tokens_long(both.address, PREAMBLE, PREAMBLE_TOKENS)
        for r in range(settings.repeat):
            work = Workload(max_tokens=16, n_ctx=2048, min_requests=1, budget_s=600.0, preamble=f"[{r}] {text}")
            results = {side: asyncio.run(http_load(both.ports[side], work, k, 3 * k, both.fields[side]))
                       for side in both.order(r)}
            for figure, read in zip(figures, reads, strict=True):
                figure.add(read(results["mpserve"]), read(results["llama-server"]))
            for side, result in results.items():
                reused[side].append(sum(sample.cached for sample in result.samples))
    return figures, (f"shared {PREAMBLE_TOKENS}-token preamble, {3 * k} requests {k} at a time; reused in all "
                     f"{_counts(reused)}")


def chat(settings: Settings, stores: str, reuse: str) -> tuple[list[Figure], str]:
    figures = [Figure(f"TTFT turn {t + 1}", "ms") for t in range(CHAT_TURNS)]
    reused: dict[str, list[int]] = {"mpserve": [], "llama-server": []}
    with sides(settings, stores, 1, 4096, reuse) as both:
        for r in range(settings.repeat):
            questions = [tokens_long(both.address, f"Chat {r}, question {t + 1}: " + " ".join(
                PROMPTS[(r + t) % len(PROMPTS):] + PROMPTS), CHAT_QUESTION_TOKENS) for t in range(CHAT_TURNS)]
            talks = {side: "" for side in both.ports}  # each side's conversation, with its own replies
            for t, question in enumerate(questions):
                ttft: dict[str, float] = {}
                for side in both.order(r + t):
                    talks[side] += f"\nUser: {question}\nAssistant:"
                    work = Workload(max_tokens=CHAT_REPLY_TOKENS, n_ctx=4096, min_requests=1, budget_s=600.0,
                                    preamble=talks[side], ending=False)
                    sample = http_request(both.ports[side], work, 0, both.fields[side])
                    talks[side] += sample.text
                    ttft[side] = sample.ttft_s * 1000
                    reused[side].append(sample.cached)
                figures[t].add(ttft["mpserve"], ttft["llama-server"])
    return figures, (f"chat, {CHAT_TURNS} turns of a {CHAT_QUESTION_TOKENS}-token question and a reply of up to "
                     f"{CHAT_REPLY_TOKENS} tokens; reused per turn {_counts(reused)}")


def _once(text: str) -> Workload:
    """A workload whose request 0 is ``text`` and a short prompt after it, 8 tokens."""
    return Workload(max_tokens=8, n_ctx=2048, min_requests=1, budget_s=600.0, preamble=text)


def _counts(reused: dict[str, list[int]]) -> str:
    return "; ".join(f"{side}: {', '.join(map(str, counts))}" for side, counts in reused.items())


RUNS = {"pushed": pushed, "preamble": preamble, "chat": chat}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cache_ram", description="mpserve's host store against "
                                     "llama-server --cache-ram, HTTP on both sides")
    parser.add_argument("--model", type=Path, help="GGUF file [default: the built-in bench model]")
    parser.add_argument("--repeat", type=int, default=3, help="repeats [default: %(default)s]")
    parser.add_argument("--cases", default=",".join(CASES), help="some of %(default)s")
    parser.add_argument("--reuse", default="any", choices=("any", "exact"), help="mpserve's reuse mode")
    parser.add_argument("--llama-server", help="llama-server binary [default: on PATH, else /opt/llama-server*/]")
    args = parser.parse_args()
    from mpserve.models.builtin import builtin_model_path

    settings = Settings.make(quick=False, repeat=args.repeat, model=args.model or builtin_model_path("bench"),
                             llama_server=find_llama_server(args.llama_server))
    if settings.llama_server is None:
        parser.error("no llama-server binary: put one on PATH or pass --llama-server")
    cases = args.cases.split(",")
    if unknown := set(cases) - set(CASES):
        parser.error(f"unknown cases {', '.join(sorted(unknown))}; the cases are {', '.join(CASES)}")
    print(f"{settings.model.name}, {settings.cores} threads on both sides, {args.repeat} repeats, mpserve reuse "
          f"{args.reuse}; mpserve vs llama-server: medians, ratio median [min–max over repeats]; load average "
          f"{_load()} at the start", flush=True)
    with tempfile.TemporaryDirectory(prefix="mpcr-", dir="/tmp") as runtime:
        os.environ["MPSERVE_RUNTIME_DIR"] = runtime
        for name in cases:
            figures, note = RUNS[name](settings, runtime, args.reuse)
            print(f"{name}: {note}", flush=True)
            for figure in figures:
                print(f"  {ratio_line(figure)}", flush=True)
    print(f"load average {_load()} at the end")


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
