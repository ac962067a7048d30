"""A wait with a time limit that keeps its task's cancellation: ``within``, ``asyncio.wait_for`` less its flaw.

``asyncio.wait_for`` before Python 3.12 returns the awaited result when its task is cancelled just as that result
comes, and the cancellation is lost: the task runs on as if nobody had stopped it (a stream's reader, stopped as its
client hung up, reading on for ever). ``within`` raises the cancellation, and cancels what it awaited (an item that
had just been taken is dropped with it: its taker is being stopped).

    within(aw, timeout) ─┬─ aw ends first ──────────▶ its result (or its error)
                         ├─ timeout passes ─────────▶ aw cancelled, waited for ─▶ TimeoutError (its result if it
                         │                                                        ended all the same)
                         └─ the caller is cancelled ─▶ aw cancelled ─▶ CancelledError
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout: float | None) -> T:
    """``aw``'s result, or ``asyncio.TimeoutError`` once ``timeout`` seconds pass (None: no limit)."""
    if timeout is None:
        return await aw  # a plain await passes a cancellation on, and keeps it
    task = asyncio.ensure_future(aw)
    try:
        await asyncio.wait((task,), timeout=timeout)
    except BaseException:  # cancelled: so is what it waits for, whose end nobody reads now
        task.cancel()
        task.add_done_callback(_retrieved)
        raise
    if not task.done():
        task.cancel()
        await asyncio.wait((task,))
        if task.cancelled():
            raise asyncio.TimeoutError
    return task.result()


def _retrieved(task: asyncio.Future[Any]) -> None:
    """An abandoned wait's end read, so that an error it ended with is not reported as never retrieved."""
    if not task.cancelled():
        task.exception()
