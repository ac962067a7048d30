"""The gateway app served by uvicorn in a thread of the test process (``GatewayThread``), for the tests that
drive the HTTP front; ``conftest`` has the ``gateway`` fixture, one in front of ``tiny_server``."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from mpserve.gateway.app import GatewayConfig, create_app


class GatewayThread:
    """The gateway app served by uvicorn in a thread, on a port of 127.0.0.1 bound before it starts."""

    def __init__(self, **config: Any) -> None:
        # IPPROTO_TCP named explicitly: asyncio sets TCP_NODELAY only on sockets that say so, and without it
        # each response waits ~40 ms for a delayed ACK
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.bind(("127.0.0.1", 0))
        port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        app = create_app(GatewayConfig(host="127.0.0.1", port=port, **config))
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.01)

    def openai(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=30)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=10, **kwargs)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics, by name and labels."""
        text = self.get("/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()
