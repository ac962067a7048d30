"""What the HTTP gateway adds to one request: OpenAI-style HTTP through ``mpserve.gateway.app`` against mpserve's
own ZeroMQ client, side by side on one echo server (``mpserve start --model echo``: no model, so the figure
is transport and framing alone).

The gateway runs as its own process, as deployed. Both paths are driven from this process, one request at
a time, interleaved (ZeroMQ, HTTP, ZeroMQ, ...) so that drift in the machine's load falls on both:

- ZeroMQ: ``mpserve.Client.generate`` (sync; a background asyncio loop);
- HTTP: ``POST /v1/completions`` with httpx on a kept-alive connection, answer parsed as JSON.

Streamed requests (``Client.stream`` against server-sent events) are measured the same way.

    python -m bench.http_overhead [--requests 200] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable

import httpx

from mpserve import Client

from .figures import percentile
from .procs import MpserveServer, free_port, wait_http

PROMPT = "The quick brown fox jumps over the lazy dog."
GATEWAY = ("from mpserve.gateway.app import GatewayConfig, serve; "
           "serve(GatewayConfig(port={port}, server_name={name!r}, log_level='warning'))")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per path and mode")
    parser.add_argument("--max-tokens", type=int, default=8, help="echo chunks per request")
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
                      f"one at a time; p50 (p90)")
                for mode, zmq_call, http_call in (("whole", zmq_whole, http_whole),
                                                  ("streamed", zmq_streamed, http_streamed)):
                    zmq_s, http_s = _interleaved(zmq_call, http_call, args.requests)
                    z50, h50 = percentile(zmq_s, 50), percentile(http_s, 50)
                    print(f"{mode:>9}: ZeroMQ {z50 * 1e6:.0f} µs ({percentile(zmq_s, 90) * 1e6:.0f}), "
                          f"HTTP {h50 * 1e6:.0f} µs ({percentile(http_s, 90) * 1e6:.0f}); "
                          f"HTTP adds {(h50 - z50) * 1e6:.0f} µs, ratio {h50 / z50:.2f}×")
        finally:
            gateway.terminate()
            gateway.wait(10)


def _interleaved(first: Callable[[], None], second: Callable[[], None], n: int) -> tuple[list[float], list[float]]:
    for _ in range(max(5, n // 20)):  # warm up both paths (connections, caches)
        first()
        second()
    a, b = [], []
    for _ in range(n):
        for call, out in ((first, a), (second, b)):
            t0 = time.perf_counter()
            call()
            out.append(time.perf_counter() - t0)
    return a, b


if __name__ == "__main__":
    main()
