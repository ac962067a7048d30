"""Priorities that preempt exactly: a request of higher priority takes the slot of a running one of lower
priority, which is parked on its worker and resumed later from its own cells and sampler, with the text it would
have had without the preemption (greedy, seeded, constrained by a JSON schema), streamed once.

What is checked is the order of events (the urgent request's answer comes before the preempted ones'), never
times; and each preempted stream's chunks against its final text and against an uninterrupted run. One slot:
batched with others, a sequence's logits can differ from its own alone on a CPU (enough to turn a greedy choice
after some hundreds of tokens), which would say nothing of the preemption.

The tiny model writes hundreds of tokens in a fraction of a second: an urgent request sent "while a low one runs" could
come after it ended. So each urgent request is sent while the instance is stopped (SIGSTOP) in the middle of the low
ones, and the instance goes on only once the broker has decided the preemption (``_scene``)."""

from __future__ import annotations

import asyncio
import os
import signal
from asyncio import Task
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from helpers import far_from_its_end, stopped_instance, stopped_running

from mpserve import AsyncClient, Result
from mpserve.errors import Cancelled

LOW = "Once upon a time"
URGENT = "Answer at once:"
LONG_JSON = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 150,
             "maxItems": 150}
KINDS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 0.9, "seed": 1234},
    "json": {"temperature": 0, "json_schema": LONG_JSON},
}


SCENES = 5  # runs of a scene whose low-priority requests all ended before their instance stopped, at most


async def _scene(server: Any, client: AsyncClient, order: list[str], lows: Callable[[], Awaitable[list[Task[Any]]]],
                 busy: int, total: int, urgent: Callable[[], Awaitable[Any]]) -> tuple[list[Task[Any]], Task[Any]]:
    """``lows()`` starts the low-priority requests (their tasks, ``busy`` of them streaming when it returns, each of
    at least ``total`` tokens); then ``urgent`` is sent while they run (``_sent_while_held``). Their tasks and the
    urgent one's. The scene runs again (what it added to ``order`` taken out) where one had ended before their
    instance stopped."""
    mark = len(order)
    for _ in range(SCENES):
        tasks = await lows()
        sent = await _sent_while_held(server, client, busy, total, urgent)
        if sent is not None:
            return tasks, sent
        await asyncio.gather(*tasks)
        del order[mark:]
    pytest.fail(f"in each of {SCENES} runs a low-priority request ended before its instance stopped")


async def _sent_while_held(server: Any, client: AsyncClient, busy: int, total: int,
                           urgent: Callable[[], Awaitable[Any]]) -> Task[Any] | None:
    """``urgent`` sent while the server's one instance is stopped (SIGSTOP) with ``busy`` requests running, each
    more than one token short of ``total``; the instance goes on once the broker has given the urgent request a
    slot (its running count past ``busy``). Its PREEMPT then waits on the worker's link, taken at the worker's next
    turn, before any victim can end: the urgent request preempts for certain, however loaded the host. None (nothing
    sent) where fewer were running so at the stop: the caller runs its scene again."""
    pid = await asyncio.to_thread(stopped_instance, server.slots)
    try:
        if sum(far_from_its_end(r, total) for r in await asyncio.to_thread(server.slots)) < busy:
            return None
        task = asyncio.create_task(urgent())
        while sum(m.running for m in (await client.stats()).models.values()) <= busy:
            await asyncio.sleep(0.01)
        return task
    finally:
        os.kill(pid, signal.SIGCONT)


async def _contend(server: Any, low: dict[str, Any], urgent: dict[str, Any], total: int
                   ) -> tuple[list[str], tuple[str, str], Any]:
    """``LOW`` streamed at priority 0 with ``low`` (``total`` tokens alone), then the urgent request at priority 10
    while it runs. The names in the order their answers came, the low stream's chunks joined and its final text, and
    the server's figures after."""
    order: list[str] = []
    async with AsyncClient(server.address, timeout=300) as client:
        async def lows() -> list[Task[tuple[str, str]]]:
            started = asyncio.Event()

            async def stream() -> tuple[str, str]:
                s = client.stream(LOW, priority=0, **low)
                chunks = []
                async for text in s:
                    chunks.append(text)
                    started.set()
                order.append("low0")
                assert s.result is not None
                return "".join(chunks), s.result.text

            task = asyncio.create_task(stream())
            await asyncio.wait_for(started.wait(), 120)
            return [task]

        async def send_urgent() -> None:
            await client.generate(URGENT, priority=10, **urgent)
            order.append("urgent")

        (task,), sent = await _scene(server, client, order, lows, 1, total, send_urgent)
        await sent
        return order, await task, await client.stats()


async def _alone(address: str, params: dict[str, Any]) -> Result:
    async with AsyncClient(address, timeout=300) as client:
        return await client.generate(LOW, **params)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
def test_an_urgent_request_preempts_and_the_preempted_text_does_not_change(start_server, kind: str) -> None:
    server = start_server("--parallel", "1", "--reuse", "exact", "--threads", "1", "--n-ctx", "2048").wait_ready()
    low = {"max_tokens": 1200, **KINDS[kind]}
    expected = asyncio.run(_alone(server.address, low))
    order, (chunks, text), stats = asyncio.run(_contend(server, low, {"max_tokens": 16, "temperature": 0},
                                                        expected.usage.completion_tokens))
    assert order == ["urgent", "low0"], "the urgent request waited for the slot"
    assert stats.counters["preempted"] == 1 and stats.models["tiny"].preempted == 1
    assert chunks == text, "the streamed chunks are not the final text (a token streamed twice, or lost)"
    assert text == expected.text, "the preempted request's text differs from its uninterrupted run"


@pytest.mark.timeout(300)
def test_the_lowest_priority_gives_way_and_comes_back_before_later_requests_of_its_priority(start_server) -> None:
    server = start_server("--parallel", "2", "--threads", "1", "--n-ctx", "8192").wait_ready()

    async def run() -> list[str]:
        order: list[str] = []
        async with AsyncClient(server.address, timeout=300) as client:
            async def one(name: str, prompt: str, priority: int, max_tokens: int) -> None:
                try:
                    async for _ in client.stream(prompt, priority=priority, max_tokens=max_tokens, temperature=0,
                                                 ignore_eos=True, request_id=name):
                        streaming.add(name)
                    order.append(name)
                except Cancelled:
                    order.append(f"{name} cancelled")

            async def lows() -> list[Task[None]]:
                streaming.clear()
                tasks = [asyncio.create_task(one("p1", "First in", 1, 8000)),
                         asyncio.create_task(one("p0", "Second in", 0, 2000))]
                while len(streaming) < 2:
                    await asyncio.sleep(0.01)
                return tasks

            async def urgent() -> None:
                # queued behind the two running ones (their instance stopped), then the urgent one; "later0" can
                # start only once "p0" is done, if "p0" resumes first: "p1" holds the other slot longer
                later.append(asyncio.create_task(one("later0", "A later one of priority 0", 0, 2000)))
                while not sum(m.queued for m in (await client.stats()).models.values()):
                    await asyncio.sleep(0.01)
                await one("urgent", URGENT, 5, 8)

            streaming: set[str] = set()
            later: list[Task[None]] = []
            (p1, p0), sent = await _scene(server, client, order, lows, 2, 2000, urgent)
            await asyncio.gather(p0, sent, *later)
            await client.cancel("p1")  # it has done its part: holding the other slot until "later0" ended
            await p1
            return order

    order = asyncio.run(run())
    assert order == ["urgent", "p0", "later0", "p1 cancelled"], f"the preempted request lost its place: {order}"


@pytest.mark.timeout(600)
def test_a_preempted_request_of_the_real_model_gives_the_text_of_its_uninterrupted_run(start_server,
                                                                                        real_model) -> None:
    server = start_server("--model", real_model.path, "--parallel", "1", "--reuse", "exact", "--threads", "1",
                          "--n-ctx", "1024").wait_ready(300)
    low = {"max_tokens": 300, "temperature": 0.8, "seed": 99}
    expected = asyncio.run(_alone(server.address, low))
    order, streamed, stats = asyncio.run(_contend(server, low, {"max_tokens": 8, "temperature": 0},
                                                  expected.usage.completion_tokens))
    assert order == ["urgent", "low0"], "the urgent request waited for the slot"
    assert stats.counters["preempted"] == 1
    assert streamed == (expected.text, expected.text)


@pytest.mark.timeout(300)
def test_a_parked_request_whose_instance_dies_continues_from_its_streamed_tokens(start_server) -> None:
    server = start_server("--parallel", "1", "--reuse", "exact", "--threads", "1", "--n-ctx", "4096").wait_ready()
    low = {"max_tokens": 1200, "temperature": 0}
    expected = asyncio.run(_alone(server.address, low))

    async def run() -> tuple[str, str, int]:
        async with AsyncClient(server.address, timeout=300) as client:
            async def stream(prompt: str, priority: int, event: asyncio.Event, **params: Any) -> tuple[str, str]:
                s = client.stream(prompt, priority=priority, **params)
                chunks = []
                async for text in s:
                    chunks.append(text)
                    event.set()
                assert s.result is not None
                return "".join(chunks), s.result.text

            async def lows() -> list[Task[tuple[str, str]]]:
                started = asyncio.Event()
                task = asyncio.create_task(stream(LOW, 0, started, **low))
                await asyncio.wait_for(started.wait(), 120)
                return [task]

            for scene in range(SCENES):
                urgent_started = asyncio.Event()

                async def urgent(scene: int = scene, started: asyncio.Event = urgent_started) -> tuple[str, str]:
                    return await stream(URGENT, 10, started, max_tokens=3000, temperature=0, ignore_eos=True,
                                        request_id=f"urgent{scene}")

                before = (await client.stats()).counters.get("preempted", 0)
                (parked,), sent = await _scene(server, client, [], lows, 1, expected.usage.completion_tokens, urgent)
                await asyncio.wait_for(urgent_started.wait(), 120)  # the low one is parked on the worker now
                pid = await asyncio.to_thread(stopped_running, server.slots, f"urgent{scene}", 3000)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)  # with the low one parked on it, for certain
                    (chunks, text), _ = await asyncio.gather(parked, sent)
                    return chunks, text, (await client.stats()).counters["preempted"] - before
                await asyncio.gather(parked, sent)  # the urgent one had ended: the scene again
            pytest.fail(f"in each of {SCENES} runs the urgent request ended before its instance stopped")

    chunks, text, preempted = asyncio.run(run())
    assert preempted == 1
    assert chunks == text == expected.text, "the parked request did not continue exactly from its streamed tokens"


@pytest.mark.timeout(300)
def test_a_parked_request_cancelled_is_forgotten_and_its_room_serves_the_next_preemption(start_server) -> None:
    server = start_server("--parallel", "1", "--threads", "1", "--n-ctx", "4096").wait_ready()

    async def run() -> list[str]:
        order: list[str] = []
        async with AsyncClient(server.address, timeout=300) as client:
            async def one(name: str, priority: int, **params: Any) -> None:
                s = client.stream(f"{name}: {LOW}", priority=priority, temperature=0, request_id=name, **params)
                started = events.setdefault(name, asyncio.Event())
                try:
                    async for _ in s:
                        started.set()
                    order.append(name)
                except Cancelled:
                    order.append(f"{name} cancelled")

            def low(name: str) -> Callable[[], Awaitable[list[Task[None]]]]:
                async def lows() -> list[Task[None]]:
                    events[name] = asyncio.Event()
                    task = asyncio.create_task(one(name, 0, max_tokens=2000, ignore_eos=True))
                    await asyncio.wait_for(events[name].wait(), 120)
                    return [task]
                return lows

            events: dict[str, asyncio.Event] = {}
            for _ in range(SCENES):
                events["urgent1"] = asyncio.Event()
                (low1,), urgent1 = await _scene(server, client, order, low("low1"), 1, 2000,
                                                lambda: one("urgent1", 10, max_tokens=2000, ignore_eos=True))
                await asyncio.wait_for(events["urgent1"].wait(), 120)  # low1 is parked
                pid = await asyncio.to_thread(stopped_running, server.slots, "urgent1", 2000)
                if pid is not None:  # low1 parked until urgent1 ends, for certain
                    await client.cancel("low1")
                    await client.stats()  # answered after the CANCEL was taken
                    os.kill(pid, signal.SIGCONT)
                await asyncio.gather(low1, urgent1)
                if pid is not None:
                    break
                order.clear()
            else:
                pytest.fail(f"in each of {SCENES} runs urgent1 ended before its instance stopped")
            (low2,), urgent2 = await _scene(server, client, order, low("low2"), 1, 2000,
                                            lambda: one("urgent2", 10, max_tokens=8))
            await asyncio.gather(low2, urgent2)
            return order

    # without the parked request forgotten, the instance would count it parked still (room for one, as it has one
    # slot) and urgent2 would wait for low2 to end
    assert asyncio.run(run()) == ["low1 cancelled", "urgent1", "urgent2", "low2"]


@pytest.mark.timeout(300)
def test_an_http_request_names_its_priority_and_preempts_too(start_server) -> None:
    import httpx
    from gateway_thread import GatewayThread

    server = start_server("--parallel", "1", "--reuse", "exact", "--threads", "1", "--n-ctx", "2048").wait_ready()
    gateway = GatewayThread(server_name=server.name)
    url = f"{gateway.url}/v1/completions"
    try:
        refused = httpx.post(url, json={"model": "tiny", "prompt": URGENT, "priority": 1000}, timeout=30)
        assert refused.status_code == 400 and "'priority' must be an integer from -100 to 100" in refused.text

        async def run() -> list[str]:
            order: list[str] = []
            async with AsyncClient(server.address, timeout=300) as client, httpx.AsyncClient(timeout=300) as http:
                async def lows() -> list[Task[None]]:
                    started = asyncio.Event()

                    async def low() -> None:
                        async for _ in client.stream(LOW, max_tokens=1200, temperature=0, ignore_eos=True):
                            started.set()
                        order.append("low")

                    task = asyncio.create_task(low())
                    await asyncio.wait_for(started.wait(), 120)
                    return [task]

                async def urgent() -> None:
                    answer = await http.post(url, json={"model": "tiny", "prompt": URGENT, "max_tokens": 8,
                                                        "temperature": 0, "priority": 10})
                    assert answer.status_code == 200, answer.text
                    order.append("urgent")

                (task,), sent = await _scene(server, client, order, lows, 1, 1200, urgent)
                await asyncio.gather(task, sent)
            return order

        assert asyncio.run(run()) == ["urgent", "low"], "the HTTP request's priority did not reach the broker"
    finally:
        gateway.stop()
