"""Images: mpserve's HTTP gateway against llama-server ``--mmproj``, both serving the random vision pair over HTTP.

    mpserve make-model vision.gguf --size tiny --mmproj mmproj.gguf   (the pair tests/test_images.py serves)
    each repeat, each side in turn (which one first alternates), started fresh while the other is stopped:
        mpserve start --model vision.gguf --mmproj mmproj.gguf --parallel 1 --threads CORES --http PORT (a host
            store of this run's own, so that no earlier run's prompts are restored)
        llama-server --model vision.gguf --mmproj mmproj.gguf --parallel 1 --threads CORES (its prompt cache on)
        warm-up ─▶ WARM_UP images (a server's first images are slower than the rest)
        rate    ─▶ REQUESTS chat completions one after another, each with a new image, 1 token each: each one's
                   time, whole; images per second: one over their median
        repeat  ─▶ TTFT_PAIRS times: a new image after the repeat's text of about TEXT_WORDS words, streamed (the
                   text reused after the first time, the image computed), then the same request again (the image's
                   positions reused from the cache too): the medians of their times to first token

Figures per side: medians over every sample of every repeat (medians, not means: the machine may be loaded by
other work, in bursts), and mpserve ÷ llama-server per figure (the median of the per-repeat ratios, and their
min–max), with the prompt tokens each side reused. The images are JPEGs of IMAGE_SIZE pixels of noise, seeded; the
projector sees each resized to its 56 × 56, so the figures are the HTTP, decode and cache path, not a vision
encoder's compute.

    python -m bench.images [--repeat 7] [--requests 32] [--llama-server PATH]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

from mpserve.repack import probe

from .figures import median
from .procs import HttpServer, MpserveServer, find_llama_server, free_port, wait_http

IMAGE_SIZE = (512, 384)
TEXT_WORDS = 200
N_CTX = 2048
WARM_UP = 4  # images each server answers before the measurements
TTFT_PAIRS = 4  # new images per repeat, each sent twice
SIDES = ("mpserve", "llama-server")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.images", description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=7, help="repeats [default: %(default)s]")
    parser.add_argument("--requests", type=int, default=32, help="images per rate measurement [default: "
                        "%(default)s]")
    parser.add_argument("--llama-server", help="the llama-server binary [default: on PATH or under /opt]")
    args = parser.parse_args()
    binary = find_llama_server(args.llama_server)
    if binary is None:
        raise SystemExit("no llama-server binary: put one on PATH or pass --llama-server (bench/README.md)")
    load = os.getloadavg()[0]
    cores = str(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="mpimages-") as tmp:
        pair = _pair(Path(tmp))
        runs = []
        for r in range(args.repeat):
            figures: dict[str, dict[str, list[float]]] = {}
            for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                with _served(side, pair, cores, binary) as url:
                    figures[side] = _measure(url, r, args.requests)
            print(f"repeat {r}: " + ", ".join(f"{side} {median(f['a new image, whole (ms)']):.0f} ms a new image, "
                                              f"TTFT {median(f['TTFT same image again (ms)']):.0f} ms the same again"
                                              for side, f in figures.items()), file=sys.stderr)
            runs.append(figures)
    print(f"python -m bench.images --repeat {args.repeat} --requests {args.requests}; the random vision pair "
          f"(tiny), --parallel 1, {cores} threads both sides, llama-server {binary}; load average {load:.1f} → "
          f"{os.getloadavg()[0]:.1f}")
    _report(runs)


def _pair(folder: Path) -> tuple[Path, Path]:
    """The random vision pair, written by ``mpserve make-model``."""
    model, projector = folder / "vision.gguf", folder / "mmproj.gguf"
    subprocess.run([sys.executable, "-m", "mpserve", "make-model", str(model), "--size", "tiny", "--mmproj",
                    str(projector)], check=True, capture_output=True)
    return model, projector


@contextmanager
def _served(side: str, pair: tuple[Path, Path], cores: str, binary: str) -> Iterator[str]:
    """``side``'s server of the pair, started fresh, ready and warmed up: its URL; stopped after."""
    model, projector = (str(path) for path in pair)
    port = free_port()
    if side == "mpserve":
        server: MpserveServer | HttpServer = MpserveServer(
            "--model", model, "--mmproj", projector, "--n-ctx", str(N_CTX), "--parallel", "1", "--threads", cores,
            "--cache-shm", str(pair[0].parent / "store"), "--http", f"127.0.0.1:{port}")  # a host store of its own
    else:
        repack = [] if probe().works else ["--no-repack"]  # its repacked kernels crash on this CPU: as mpserve does
        server = HttpServer([binary, "--model", model, "--mmproj", projector, "--host", "127.0.0.1", "--port",
                             str(port), "--threads", cores, "--threads-batch", cores, "--parallel", "1",
                             "--ctx-size", str(N_CTX), *repack], port, "/health")
    url = f"http://127.0.0.1:{port}"
    with server:
        server.wait_ready()
        if not wait_http(f"{url}/health"):
            raise RuntimeError(f"{side} did not answer on port {port}")
        for i in range(WARM_UP):
            _chat(url, _image(i), "Hello.", 1, stream=False)
        yield url


def _measure(url: str, r: int, requests: int) -> dict[str, list[float]]:
    """Repeat ``r``'s samples of the server at ``url``: each request's milliseconds, and the prompt tokens reused."""
    seed = 1000 * (r + 1)
    whole = [_chat(url, _image(seed + i), "What is this?", 1, stream=False)[0] for i in range(requests)]
    text = f"Request {r}. " + " ".join(f"word{k % 50}" for k in range(TEXT_WORDS)) + " What is in the picture?"
    asks = [_chat(url, _image(seed + requests + k), text, 8, stream=True) for k in range(TTFT_PAIRS) for _ in "12"]
    return {"a new image, whole (ms)": whole,
            "TTFT new image (ms)": [t for t, _ in asks[0::2]],
            "TTFT same image again (ms)": [t for t, _ in asks[1::2]],
            "cached tokens, new": [c for _, c in asks[0::2]],
            "cached tokens, again": [c for _, c in asks[1::2]]}


def _image(seed: int) -> bytes:
    """A JPEG of noise, IMAGE_SIZE pixels, from ``seed``."""
    pixels = np.random.default_rng(seed).integers(0, 256, (IMAGE_SIZE[1], IMAGE_SIZE[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=85)
    return out.getvalue()


def _chat(url: str, image: bytes, text: str, max_tokens: int, stream: bool) -> tuple[float, int]:
    """One chat completion with ``image`` after ``text``: milliseconds to the first text (to the whole answer when
    not streamed), and the prompt tokens the server reused."""
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {
        "url": "data:image/jpeg;base64," + base64.b64encode(image).decode()}}]
    body: dict[str, Any] = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                            "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    started, first, cached = time.perf_counter(), 0.0, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {reply.status_code}: {reply.read()[:500]!r}")
        for line in reply.iter_lines():
            event = json.loads(line.removeprefix("data: ")) if line.startswith(("data: {", "{")) else {}
            if any(choice.get("delta", {}).get("content") for choice in event.get("choices", ())):
                first = first or time.perf_counter()
            cached = _cached(event, cached)
    return ((first or time.perf_counter()) - started) * 1000, cached


def _cached(event: dict[str, Any], known: int) -> int:
    """The reused prompt tokens an event reports: mpserve's usage, llama-server's timings (cache_n)."""
    details = (event.get("usage") or {}).get("prompt_tokens_details") or {}
    timings = event.get("timings") or {}
    return int(details.get("cached_tokens", timings.get("cache_n", known)))


def _report(runs: list[dict[str, dict[str, list[float]]]]) -> None:
    """Per figure, each side's median over every sample of every repeat, and mpserve ÷ llama-server: the median of
    the per-repeat ratios of medians, and their min–max. Images per second: one over a whole request's median."""
    print("| figure | mpserve | llama-server --mmproj | mpserve ÷ llama-server (min–max over the repeats) |")
    print("| --- | --- | --- | --- |")
    for name in runs[0]["mpserve"]:
        ours, theirs = (median([v for run in runs for v in run[side][name]]) for side in SIDES)
        ratios = [median(run["mpserve"][name]) / median(run["llama-server"][name]) for run in runs]
        shown = "–" if name.startswith("cached") else f"{median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})"
        print(f"| {name} | {ours:.1f} | {theirs:.1f} | {shown} |")
        if name.startswith("a new image"):
            inverse = [1 / ratio for ratio in ratios]
            print(f"| images/s (1 ÷ that median) | {1000 / ours:.1f} | {1000 / theirs:.1f} | {median(inverse):.2f}× "
                  f"({min(inverse):.2f}–{max(inverse):.2f}) |")


if __name__ == "__main__":
    main()
