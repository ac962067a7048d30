"""Answers onto the wire at the least cost per byte: JSON bodies and server-sent events.

    a dict ──▶ msgspec's JSON encoder (C) ──▶ JSONResponse body
    the events of one piece of text ──▶ frames ──▶ one bytes ──▶ EventStream ──▶ one ASGI send

A streamed request's events are the gateway's cost per token, so each is made once, in C, and the events
that a piece of text gives (a chunk per choice, or the held-back tool calls) leave in one send: one trip
through the ASGI layers and one write on the socket. ``EventStream`` is a plain ASGI response: its answer
starts at once (no task group per request, as Starlette's ``StreamingResponse`` makes) and one watcher task
notices a client that hangs up, which cancels the stream, and with it the generation, at once.

JSON as Starlette's ``JSONResponse`` writes it (UTF-8, no spaces), except that a number that is not finite
(a log-probability of minus infinity) is written as ``null``, valid JSON, where Python's encoder writes
``-Infinity`` (not JSON) or refuses it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Iterable
from typing import Any

import msgspec
from starlette.responses import JSONResponse as _StarletteJSON
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

_encoder = msgspec.json.Encoder()
dumps = _encoder.encode

DONE = b"data: [DONE]\n\n"
_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(obj: Any) -> bytes:
    """One server-sent event whose data is ``obj`` as JSON."""
    return b"data: " + dumps(obj) + b"\n\n"


def events(objs: Iterable[Any]) -> bytes:
    """Several events in one piece (empty for none)."""
    return b"".join([b"data: " + dumps(obj) + b"\n\n" for obj in objs])


class JSONResponse(_StarletteJSON):
    """Starlette's JSON response, encoded by msgspec."""

    def render(self, content: Any) -> bytes:
        return dumps(content)


class EventStream(Response):
    """A ``text/event-stream`` answer of the frames ``frames`` yields, each sent as it comes (empty ones are
    skipped). The generator is always closed when the answer ends, whether it ran out, failed, or its
    client hung up (which cancels it at once). Its headers are a Response's: they may be added to."""

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncGenerator[bytes, None], headers: dict[str, str] | None = None) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({**_HEADERS, **(headers or {})})
        self._frames = frames

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        gone = asyncio.ensure_future(hang_up(receive))
        try:
            await asyncio.wait((pump, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not pump.done():
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump
            await self._frames.aclose()
        if not pump.cancelled():
            pump.result()  # its error, if it failed

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for frame in self._frames:
            if frame:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def hang_up(receive: Receive) -> None:
    """Returns once the client is gone (or the answer is complete: the server then says the same)."""
    while (await receive())["type"] != "http.disconnect":
        pass
