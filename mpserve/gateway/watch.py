"""The HTTP client while its answer is made: the wait that notices it leave, and the event stream that is
always closed when its response ends. Shared by every generating endpoint (``app``, ``dialect``).

    request ──unless_disconnected(work)──▶ work's result, or ClientGone (work cancelled: the mpserve request
                                           is cancelled with it)
    events  ──EventStream──▶ text/event-stream; the generator closed when the response ends, however it ends
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client closed its connection before its answer was ready."""


async def first(chunks: AsyncIterator[str]) -> str | None:
    """The first piece of text, or None for a completion that ended without any."""
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Await ``work`` unless the HTTP client disconnects first: then cancel it (which cancels the mpserve
    request) and raise ClientGone. Starlette only notices a disconnect while a response streams; this
    covers the time before, when a request may wait in the queue or run for long."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    done: set[asyncio.Future[Any]] = set()
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task in done:
        return task.result()
    raise ClientGone()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """Server-sent events whose generator is always closed when the response ends. When the client leaves
    while an event is being sent, Starlette cancels the send and leaves the generator to the garbage
    collector; closing it here cancels the generation at once."""

    def __init__(self, events: AsyncGenerator[bytes, None], headers: dict[str, str] | None = None) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
