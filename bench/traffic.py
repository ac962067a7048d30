"""The messages of streamed generation without a model: an echo server with as many 1-slot instances as a
configuration has, each making a piece every ``tick_ms`` (a model's time per token), streamed to as many
lanes of ``AsyncClient`` in a thread of this process, from the block's start to its end.

    this process: lanes (AsyncClient, a thread)  <->  broker  <->  echo workers, a piece per tick

Run beside independent llama_cpp processes, it shows what the serving path's messages alone take from them
on the same cores: the broker, the workers' loops, libzmq's threads and the client, with no decoding.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
from pathlib import Path
from types import TracebackType

import yaml

from mpserve import AsyncClient

from .procs import MpserveServer

CHARS_PER_PIECE = 4  # about a token's text


class EchoTraffic:
    def __init__(self, instances: int, tick_ms: float, max_tokens: int) -> None:
        self._instances = instances
        self._tick_ms = tick_ms
        self._max_tokens = max_tokens
        self._dir = tempfile.TemporaryDirectory(prefix="mpserve-traffic-")
        self._server: MpserveServer | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._started = threading.Event()
        self._failed: BaseException | None = None

    def __enter__(self) -> EchoTraffic:
        config = Path(self._dir.name) / "echo.yaml"
        config.write_text(yaml.safe_dump({"models": [{"name": "echo", "path": "echo", "instances": self._instances,
                                                       "parallel": 1, "echo_tick_ms": self._tick_ms}]}))
        self._server = MpserveServer("--config", str(config))
        try:
            self._server.wait_ready()
            self._thread = threading.Thread(target=asyncio.run, args=(self._lanes(self._server.address),),
                                            daemon=True)
            self._thread.start()
            if not self._started.wait(timeout=30) or self._failed is not None:
                raise RuntimeError("the echo traffic streamed no chunk") from self._failed
        except BaseException as e:
            self.__exit__(type(e), e, e.__traceback__)
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._server is not None:
            self._server.stop()
        self._dir.cleanup()
        if self._failed is not None and kind is None:  # what was measured beside it did not have it throughout
            raise RuntimeError("the echo traffic stopped before the block ended") from self._failed

    async def _lanes(self, address: str) -> None:
        try:
            async with AsyncClient(address) as client:
                await asyncio.gather(*(self._lane(client) for _ in range(self._instances)))
        except BaseException as e:  # reported by __enter__ or __exit__
            self._failed = e
            self._started.set()  # __enter__ waits no longer

    async def _lane(self, client: AsyncClient) -> None:
        prompt = "x" * (CHARS_PER_PIECE * self._max_tokens)  # the echo backend cuts it into max_tokens pieces
        while not self._stop.is_set():
            async for _ in client.stream(prompt, max_tokens=self._max_tokens):
                self._started.set()
