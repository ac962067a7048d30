"""``within``: a wait with a time limit whose task, cancelled as what it waits for ends, is cancelled all the same
(``asyncio.wait_for`` before Python 3.12 returns the result and loses the cancellation)."""

from __future__ import annotations

import asyncio

import pytest

from mpserve.waits import within

pytestmark = pytest.mark.timeout(30)


async def _cancelled_as_it_ends(turns: int) -> tuple[bool, str]:
    """A task waiting (within 5 s) on an event that is set, cancelled ``turns`` loop turns later: whether it had
    ended before the cancel, and how it ended."""
    event = asyncio.Event()

    async def waiter() -> str:
        await within(event.wait(), 5)
        return "returned"

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0)  # not a wait: one loop turn, in which the task starts waiting
    event.set()
    for _ in range(turns):
        await asyncio.sleep(0)  # not a wait: loop turns, counted
    ended_before = task.done()
    task.cancel()
    try:
        return ended_before, await task
    except asyncio.CancelledError:
        return ended_before, "cancelled"


@pytest.mark.parametrize("turns", range(6))
def test_a_task_cancelled_as_its_wait_ends_is_cancelled_unless_it_had_ended(turns: int) -> None:
    ended_before, outcome = asyncio.run(_cancelled_as_it_ends(turns))
    assert outcome == ("returned" if ended_before else "cancelled")


def test_the_result_comes_back_and_a_wait_past_its_limit_raises_and_cancels_what_it_waited_for() -> None:
    async def run() -> None:
        assert await within(asyncio.sleep(0, "done"), 5) == "done"  # not a wait: a value after a turn
        assert await within(asyncio.sleep(0, "no limit"), None) == "no limit"  # not a wait: the same
        queue: asyncio.Queue[int] = asyncio.Queue()
        with pytest.raises(asyncio.TimeoutError):
            await within(queue.get(), 0.05)
        queue.put_nowait(1)
        assert queue.get_nowait() == 1  # the timed-out get took nothing: it was cancelled before the item came

    asyncio.run(run())
