"""The HTTP client while its answer is made: the wait that notices it leave before the answer starts. Shared by
every generating endpoint (``api.dialect``) and ``app``; once an event stream starts, ``encode.EventStream`` watches.

    request ──unless_disconnected(work)──▶ work's result, or ClientGone (work cancelled: the mpserve request
                                           is cancelled with it)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from starlette.requests import Request

from .encode import hang_up

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
    watcher = asyncio.ensure_future(hang_up(request.receive))
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

