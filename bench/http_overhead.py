"""What the HTTP gateway adds to one request: OpenAI-style HTTP through ``mpserve.gateway.app`` against mpserve's
own ZeroMQ client, side by side on one echo server (``mpserve start --model echo``: no model, so the figure
is transport and framing alone).

The gateway runs as its own process, as deployed. Both paths are driven from this process, one request at
a time, interleaved (ZeroMQ, HTTP, ZeroMQ, ...) so that drift in the machine's load falls on both:

- ZeroMQ: ``mpserve.Client.generate`` (sync; a background asyncio loop);
- HTTP: ``POST /v1/completions`` with httpx on a kept-alive connection, answer parsed as JSON.

Streamed requests (``Client.stream`` against server-sent events) are measured the same way.

Time on a busy host is mostly waiting, so each path's CPU per request is measured too, per process (from
the scheduler's counters, every thread): the gateway, the server (its broker), the worker, and this
process (the client: httpx, or mpserve's ZeroMQ client). The paths take turns in blocks of ten requests,
each block metered alone.

With py-spy on PATH, the gateway's share is then split by layer: py-spy samples the gateway while this
process sends it HTTP requests back to back, and each sample goes to the layer of its innermost frame that
is in one (``LAYERS``): time in C goes to the Python function that called it (a socket write to asyncio's
transport, a ZeroMQ send to pyzmq), and time in the standard library's helpers (dataclasses, enum, pathlib)
to the layer that called them. py-spy counts a thread that waits for a CPU as busy, so where cores are few
a call that wakes another process also collects the wait for the CPU that follows it.

    python -m bench.http_overhead [--requests 200] [--max-tokens 8] [--profile-s 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from mpserve import Client

from .figures import percentile
from .procs import MpserveServer, cpu_seconds, descendants, free_port, py_spy, wait_http

PROMPT = "The quick brown fox jumps over the lazy dog."
BLOCK = 10  # requests of one path between turns (and per CPU reading)
GATEWAY = ("from mpserve.gateway.app import GatewayConfig, serve; "
           "serve(GatewayConfig(port={port}, server_name={name!r}, log_level='warning'))")
LAYERS = (  # a frame's layer: the first with a fragment of the frame's file path (as "/path/file.py:line)")
    ("HTTP server (uvicorn, httptools, the guard)", ("/uvicorn/", "httptools", "mpserve/gateway/http/guard.py")),
    ("Starlette and the middleware", ("/starlette/", "mpserve/gateway/http/request_ids.py",
                                      "mpserve/gateway/http/browser.py")),
    ("JSON and SSE framing", ("mpserve/gateway/http/encode.py", "/json/", "msgspec")),
    ("link to the broker (AsyncClient, wire, pyzmq)", ("mpserve/client.py", "mpserve/wire/", "/zmq/")),
    ("metrics (prometheus_client)", ("prometheus_client", "mpserve/gateway/ops/metrics.py")),
    ("OpenAI shapes and the gateway's own logic", ("mpserve/gateway/",)),
    ("event loop and socket I/O (asyncio)", ("/asyncio/", "selectors.py")),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per path and mode")
    parser.add_argument("--max-tokens", type=int, default=8, help="echo chunks per request")
    parser.add_argument("--profile-s", type=float, default=5.0, help="seconds of py-spy on the gateway per mode "
                        "(0: none)")
    args = parser.parse_args()
    with MpserveServer("--model", "echo", "--instances", "1") as server:
        server.wait_ready()
        port = free_port()
        gateway = subprocess.Popen([sys.executable, "-c", GATEWAY.format(port=port, name=server.name)])
        try:
            url = f"http://127.0.0.1:{port}"
            with Client(server.address) as zmq_client, httpx.Client(base_url=url, timeout=30) as http:
                if not wait_http(url + "/health", 30.0):
                    raise RuntimeError("the gateway did not become healthy")
                params = {"max_tokens": args.max_tokens, "temperature": 0}
                body = {"model": "echo", "prompt": PROMPT, **params}

                def zmq_whole() -> None:
                    zmq_client.generate(PROMPT, **params)

                def http_whole() -> None:
                    http.post("/v1/completions", json=body).raise_for_status()

                def zmq_streamed() -> None:
                    for _ in zmq_client.stream(PROMPT, **params):
                        pass

                def http_streamed() -> None:
                    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
                        response.raise_for_status()
                        for _ in response.iter_lines():
                            pass

                print(f"echo backend, {args.max_tokens} chunks per request, {args.requests} requests per path, "
                      f"one at a time; p50 (p90); CPU µs per request by process")
                procs = {"gateway": [gateway.pid], "server": [server.proc.pid],
                         "worker": descendants(server.proc.pid)}
                for mode, zmq_call, http_call in (("whole", zmq_whole, http_whole),
                                                  ("streamed", zmq_streamed, http_streamed)):
                    zmq, web = _interleaved(zmq_call, http_call, args.requests, procs)
                    z50, h50 = percentile(zmq.seconds, 50), percentile(web.seconds, 50)
                    print(f"{mode:>9}: ZeroMQ {z50 * 1e6:.0f} µs ({percentile(zmq.seconds, 90) * 1e6:.0f}), "
                          f"HTTP {h50 * 1e6:.0f} µs ({percentile(web.seconds, 90) * 1e6:.0f}); "
                          f"HTTP adds {(h50 - z50) * 1e6:.0f} µs, ratio {h50 / z50:.2f}×")
                    for name, path in (("ZeroMQ", zmq), ("HTTP", web)):
                        print(f"{'':>11}CPU {name:<6} {path.cpu_total():5.0f} µs = " + ", ".join(
                            f"{proc} {us:.0f}" for proc, us in path.cpu_per_request().items()))
                    print(f"{'':>11}CPU ratio {web.cpu_total() / zmq.cpu_total():.2f}×")
                    if args.profile_s > 0 and shutil.which("py-spy"):
                        print(f"{'':>11}gateway by layer: {_layers(gateway.pid, http_call, args.profile_s)}")
                if args.profile_s > 0 and not shutil.which("py-spy"):
                    print("no py-spy on PATH: the gateway was not split by layer (pip install py-spy)")
        finally:
            gateway.terminate()
            gateway.wait(10)


@dataclass
class _Path:
    seconds: list[float] = field(default_factory=list)  # per request
    cpu_s: dict[str, float] = field(default_factory=dict)  # per process, over all requests

    def cpu_per_request(self) -> dict[str, float]:
        return {proc: s / len(self.seconds) * 1e6 for proc, s in self.cpu_s.items()}

    def cpu_total(self) -> float:
        return sum(self.cpu_per_request().values())


def _interleaved(first: Callable[[], None], second: Callable[[], None], n: int,
                 procs: dict[str, list[int]]) -> tuple[_Path, _Path]:
    for _ in range(max(5, n // 20)):  # warm up both paths (connections, caches)
        first()
        second()
    a, b = _Path(), _Path()
    for _ in range(max(1, n // BLOCK)):
        for call, path in ((first, a), (second, b)):
            before = _cpu_now(procs)
            for _ in range(BLOCK):
                t0 = time.perf_counter()
                call()
                path.seconds.append(time.perf_counter() - t0)
            for proc, seconds in _cpu_now(procs).items():
                path.cpu_s[proc] = path.cpu_s.get(proc, 0.0) + seconds - before[proc]
    return a, b


def _layers(pid: int, call: Callable[[], None], seconds: float) -> str:
    """py-spy on ``pid`` while ``call`` runs back to back for ``seconds``: its busy samples' shares by layer."""
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "gateway.txt"
        spy = py_spy(pid, seconds, output, rate=1000)
        while spy.poll() is None:
            call()
        if not output.exists():
            return "py-spy wrote no profile (it needs ptrace rights over the gateway)"
        shares = layer_shares(output.read_text().splitlines())
    return ", ".join(f"{layer} {share:.0%}" for layer, share in shares.items())


def layer_shares(raw: Iterable[str]) -> dict[str, float]:
    """py-spy's raw lines (``frame;frame;... count``, innermost last) as each layer's share of the samples,
    largest first. py-spy leaves out a thread that is not running (without ``--idle``), so the event loop's poll
    counts only for the system call's own work."""
    counts: Counter[str] = Counter()
    for line in raw:
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        counts[next((layer for frame in reversed(frames) if (layer := _layer(frame))), "other")] += int(count)
    total = sum(counts.values()) or 1
    return {layer: n / total for layer, n in counts.most_common()}


def _layer(frame: str) -> str | None:
    """The layer of a py-spy frame, ``function (path:line)``; the path is relative where it is on sys.path."""
    path = "/" + frame[frame.rfind("(") + 1:]
    return next((layer for layer, places in LAYERS if any(place in path for place in places)), None)


def _cpu_now(procs: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far of each group of processes, and of this one (the client)."""
    return {**{proc: sum(cpu_seconds(pid) for pid in pids) for proc, pids in procs.items()},
            "client": cpu_seconds(os.getpid())}


if __name__ == "__main__":
    main()
