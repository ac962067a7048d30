"""Continuous batching: aggregate tokens/s of ``mpserve.engine.batch.BatchEngine`` with K sequences per step.

For each K (1, 2, 4, 8) the engine runs K requests at a time (concurrency = K, a new request admitted
into a slot as soon as it frees, into the slot ``best_slot`` picks), greedy, the same ``max_tokens``
for all, ``threads`` llama.cpp threads; once with flash attention auto (mpserve's default and
llama-server's; on, on a CPU) and once with it off. Beside it, in the same run, taking turns, on the same GGUF,
prompts and settings: ``llama-server --parallel K --threads T`` driven by K client threads through its
``/completion`` endpoint, when a binary is found, with ``cache_prompt: false``: llama-server keeps
every prompt it has seen in a host-memory cache and would restore a repeated one instead of computing
it, where the engine reuses only what a slot still holds. Reported per K: tokens/s (median and best repeat: on
a shared machine a busy moment only ever slows a run down), the gain over K = 1, the ratio to
llama-server, whether the greedy texts equal those of the same engine serving one request at a time
(and llama-server's), and the time a step spends outside ``llama_decode`` (Python: scheduling, the
sampling calls, detokenizing, callbacks).

    python -m bench.batch_bench                        # bench model, K = 1,2,4,8, 3 repeats
    python -m bench.batch_bench --llama-server /opt/llama-server/llama-server --ks 4 --repeat 5
    python -m bench.batch_bench --quick                # tiny model, a few tokens: the harness works

The engine runs in this process (no sockets: it is the compute core); llama-server answers over HTTP
on loopback, whose cost per request is small next to 64 generated tokens. Markdown goes to stdout,
progress to stderr, the figures as JSON to ``--json`` when given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mpserve.engine.batch import BatchEngine
from mpserve.engine.settings import EngineSettings
from mpserve.models.builtin import builtin_model_path
from mpserve.wire.protocol import GenerateParams

from .load import PROMPTS
from .procs import HttpServer, find_llama_server, free_port

ENGINES = {"BatchEngine": "auto", "BatchEngine FA off": "off"}  # name -> flash attention
DEFAULT_ENGINE = "BatchEngine"  # mpserve's default, flash attention auto, as llama-server's
SERVER = "llama-server"


@dataclass
class Row:
    """One K: tokens/s per repeat for each contender, and the step figures of the default engine."""

    k: int
    tokens_per_s: dict[str, list[float]] = field(default_factory=dict)
    outside_decode_share: list[float] = field(default_factory=list)  # of step time
    outside_decode_us: list[float] = field(default_factory=list)  # per step
    loop_outside_decode_share: list[float] = field(default_factory=list)  # of the whole serving loop
    same_text: dict[str, str] = field(default_factory=dict)  # engine -> "equal/all" greedy texts vs llama-server
    same_as_alone: dict[str, str] = field(default_factory=dict)  # engine -> "equal/all" vs one at a time


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    model = Path(args.model) if args.model else builtin_model_path("tiny" if args.quick else "bench")
    server = find_llama_server(args.llama_server)
    prompts = list(PROMPTS)
    rows = []
    _progress("greedy texts one at a time (K=1), to compare the batched ones with")
    alone = {name: _texts_alone(model, prompts, fa, args) for name, fa in ENGINES.items()}
    for k in (int(k) for k in args.ks.split(",")):
        row = Row(k)
        rows.append(row)
        _progress(f"K={k}: loading")
        engines = {name: BatchEngine(EngineSettings(str(model), n_ctx=args.n_ctx, parallel=k, threads=args.threads,
                                                    n_gpu_layers=0, kv_unified=args.kv_unified, flash_attn=fa))
                   for name, fa in ENGINES.items()}
        peer = _start_llama_server(server, model, k, args) if server else None
        try:
            requests = [prompts[i % len(prompts)] for i in range(k * args.rounds)]
            for engine in engines.values():  # warm-up: one prompt per slot
                _run_engine(engine, prompts[:k], 4)
            if peer:
                _run_server(peer, prompts[:k], k, 4)
            texts: dict[str, dict[str, str]] = {}
            for r in range(args.repeat):  # the contenders take turns, so a busy moment hits all of them
                line = [f"K={k} repeat {r + 1}:"]
                for name, engine in engines.items():
                    found, tps, share, per_step_us, loop_share = _run_engine(engine, requests, args.max_tokens)
                    texts[name] = found
                    row.tokens_per_s.setdefault(name, []).append(tps)
                    if name == DEFAULT_ENGINE:
                        row.outside_decode_share.append(share)
                        row.outside_decode_us.append(per_step_us)
                        row.loop_outside_decode_share.append(loop_share)
                    line.append(f"{name} {tps:.1f} tok/s")
                if peer:
                    texts[SERVER], tps = _run_server(peer, requests, k, args.max_tokens)
                    row.tokens_per_s.setdefault(SERVER, []).append(tps)
                    line.append(f"{SERVER} {tps:.1f} tok/s")
                _progress(", ".join(line))
            for name in engines:
                same = sum(alone[name][p] == t for p, t in texts[name].items())
                row.same_as_alone[name] = f"{same}/{len(texts[name])}"
            if peer:
                row.same_text = {name: f"{sum(texts[name][p] == texts[SERVER].get(p) for p in texts[name])}/"
                                       f"{len(texts[name])}" for name in engines}
        finally:
            for engine in engines.values():
                engine.close()
            if peer:
                peer.stop()
    print(_report(rows, model, server, args))
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "model": str(model), "llama_server": server,
                                               "rows": [asdict(r) for r in rows]}, indent=2))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.batch_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="GGUF file [default: the built-in bench model]")
    parser.add_argument("--llama-server", help="llama-server binary [default: on PATH, /opt/llama-server*, /tmp/lcp*]")
    parser.add_argument("--no-llama-server", action="store_true", help="leave llama-server out")
    parser.add_argument("--ks", default="1,2,4,8", help="sequences per batch, comma-separated [1,2,4,8]")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=512, help="context per sequence [512]")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="requests per lane in one measurement [3]")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--kv-unified", action="store_true", help="one KV pool shared by the sequences")
    parser.add_argument("--quick", action="store_true", help="tiny model, 8 tokens, 1 repeat")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_tokens, args.repeat, args.rounds = 8, 1, 1
    if args.no_llama_server:
        args.llama_server = ""
    return args


def _texts_alone(model: Path, prompts: list[str], flash_attn: str, args: argparse.Namespace) -> dict[str, str]:
    engine = BatchEngine(EngineSettings(str(model), n_ctx=args.n_ctx, parallel=1, threads=args.threads, n_gpu_layers=0,
                                        kv_unified=args.kv_unified, flash_attn=flash_attn))
    try:
        return _run_engine(engine, prompts, args.max_tokens)[0]
    finally:
        engine.close()


def _run_engine(engine: BatchEngine, prompts: list[str], max_tokens: int
                ) -> tuple[dict[str, str], float, float, float, float]:
    """Serve ``prompts`` with all slots busy; texts, tokens/s, the share of step time outside llama_decode,
    microseconds per step outside it, and the share of the whole loop (admissions included) outside it."""
    params = GenerateParams(max_tokens=max_tokens, temperature=0.0)
    pending = list(prompts)
    prompt_of: dict[int, str] = {}
    texts: dict[str, str] = {}
    tokens = 0
    before = engine.stats()
    started = time.perf_counter()
    while pending or engine.active:
        while pending and engine.free_slots():
            slot, _ = engine.best_slot(pending[0])
            prompt_of[slot] = pending.pop(0)
            engine.admit(slot, prompt_of[slot], params, _keep_going)
        for slot, completion in engine.step():
            texts[prompt_of.pop(slot)] = completion.text
            tokens += completion.completion_tokens
    wall = time.perf_counter() - started
    after = engine.stats()
    step_s, decode_s = after.step_s - before.step_s, after.decode_s - before.decode_s
    steps = after.steps - before.steps
    return (texts, tokens / wall, (step_s - decode_s) / step_s, (step_s - decode_s) / steps * 1e6,
            (wall - decode_s) / wall)


def _keep_going(text: str, tokens: int) -> bool:
    return True


def _start_llama_server(binary: str, model: Path, k: int, args: argparse.Namespace) -> HttpServer:
    port = free_port()
    server = HttpServer([binary, "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                         "--parallel", str(k), "--threads", str(args.threads), "--threads-batch", str(args.threads),
                         "--ctx-size", str(k * args.n_ctx)], port, "/health")
    server.wait_ready()
    return server


def _run_server(server: HttpServer, prompts: list[str], k: int, max_tokens: int) -> tuple[dict[str, str], float]:
    """K client threads, each posting its share of ``prompts`` one after another."""
    texts: dict[str, str] = {}
    tokens = [0] * k
    errors: list[BaseException] = []

    def lane(i: int) -> None:
        try:
            for prompt in prompts[i::k]:
                body = json.dumps({"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0,
                                   "cache_prompt": False}).encode()
                request = urllib.request.Request(server.url + "/completion", body,
                                                 {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=600) as reply:
                    answer = json.load(reply)
                texts[prompt] = answer["content"]
                tokens[i] += answer["tokens_predicted"]
        except BaseException as exc:  # reported after the join
            errors.append(exc)

    lanes = [threading.Thread(target=lane, args=(i,)) for i in range(k)]
    started = time.perf_counter()
    for t in lanes:
        t.start()
    for t in lanes:
        t.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    return texts, sum(tokens) / wall


def _report(rows: list[Row], model: Path, server: str | None, args: argparse.Namespace) -> str:
    """One line per K: median tokens/s (best repeat in brackets) of each contender, the gain over K = 1,
    the ratios to llama-server (median of the per-repeat ratios, and best ÷ best), and the step figures."""
    med = statistics.median
    names = list(ENGINES) + ([SERVER] if server else [])
    base = {name: max(rows[0].tokens_per_s[name]) for name in ENGINES} if rows and rows[0].k == 1 else {}
    head = ["K = concurrency"] + [f"{n} tok/s" for n in names] + [f"{n} × K=1 (best)" for n in base]
    if server:
        head += [f"{n} ÷ {SERVER}: median, best" for n in ENGINES] + [f"same greedy text as {SERVER}"]
    head += ["same greedy text as one at a time"]
    head += ["outside llama_decode: share of step", "per step", "share of the serving loop"]
    lines = [
        "## Continuous batching: BatchEngine vs llama-server",
        "",
        f"model `{model.name}`, threads {args.threads}, n_ctx {args.n_ctx} per sequence"
        f"{', one KV pool' if args.kv_unified else ', a KV stream per sequence'}, greedy, {args.max_tokens} "
        f"tokens per request, {args.rounds} requests per lane; tokens/s: median over {args.repeat} repeats "
        "(best in brackets); BatchEngine: flash attention auto, as mpserve's default"
        + (f"; llama-server `{server}` (flash attention auto, its default)" if server
           else "; llama-server: not found, left out"),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        cells = [str(r.k)]
        cells += [f"{med(r.tokens_per_s[n]):.1f} ({max(r.tokens_per_s[n]):.1f})" for n in names]
        cells += [f"{max(r.tokens_per_s[n]) / base[n]:.2f}×" for n in base]
        if server:
            peer = r.tokens_per_s[SERVER]
            for n in ENGINES:
                ratios = [a / b for a, b in zip(r.tokens_per_s[n], peer, strict=True)]
                cells.append(f"{med(ratios):.2f}×, {max(r.tokens_per_s[n]) / max(peer):.2f}×")
            cells.append(", ".join(f"{n} {v}" for n, v in r.same_text.items()))
        cells.append(", ".join(f"{n} {v}" for n, v in r.same_as_alone.items()))
        cells += [f"{med(r.outside_decode_share):.2%}", f"{med(r.outside_decode_us):.0f} µs",
                  f"{med(r.loop_outside_decode_share):.2%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
