"""Priorities that preempt exactly: a request of higher priority takes the slot of a running one of lower
priority, which is parked on its worker and resumed later from its own cells and sampler, with the text it would
have had without the preemption (greedy, seeded, constrained by a JSON schema), streamed once.

What is checked is the order of events (the urgent request's answer comes before the preempted ones'), never
times; and each preempted stream's chunks against its final text and against an uninterrupted run. One slot:
batched with others, a sequence's logits can differ from its own alone on a CPU (enough to turn a greedy choice
after some hundreds of tokens), which would say nothing of the preemption."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest

from mpserve import AsyncClient
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


async def _contend(address: str, low: dict[str, Any], urgent: dict[str, Any], prompts: list[str]
                   ) -> tuple[list[str], list[tuple[str, str]], Any]:
    """``prompts`` streamed at priority 0 with ``low`` until each has streamed text; then the urgent request at
    priority 10. The names in the order their answers came, each stream's chunks joined and its final text, and
    the server's figures after."""
    order: list[str] = []
    async with AsyncClient(address, timeout=300) as client:
        started = [asyncio.Event() for _ in prompts]

        async def stream(i: int) -> tuple[str, str]:
            s = client.stream(prompts[i], priority=0, **low)
            chunks = []
            async for text in s:
                chunks.append(text)
                started[i].set()
            order.append(f"low{i}")
            assert s.result is not None
            return "".join(chunks), s.result.text

        tasks = [asyncio.create_task(stream(i)) for i in range(len(prompts))]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        assert not order, "a low-priority request ended before the urgent one came: make it longer"
        await client.generate(URGENT, priority=10, **urgent)
        order.append("urgent")
        streamed = await asyncio.gather(*tasks)
        return order, streamed, await client.stats()


async def _alone(address: str, params: dict[str, Any], prompts: list[str]) -> list[str]:
    async with AsyncClient(address, timeout=300) as client:
        return [(await client.generate(p, **params)).text for p in prompts]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
def test_an_urgent_request_preempts_and_the_preempted_text_does_not_change(start_server, kind: str) -> None:
    server = start_server("--parallel", "1", "--reuse", "exact", "--threads", "1", "--n-ctx", "2048").wait_ready()
    low = {"max_tokens": 1200, **KINDS[kind]}
    expected = asyncio.run(_alone(server.address, low, [LOW]))
    order, streamed, stats = asyncio.run(_contend(server.address, low, {"max_tokens": 16, "temperature": 0}, [LOW]))
    assert order == ["urgent", "low0"], "the urgent request waited for the slot"
    assert stats.counters["preempted"] == 1 and stats.models["tiny"].preempted == 1
    chunks, text = streamed[0]
    assert chunks == text, "the streamed chunks are not the final text (a token streamed twice, or lost)"
    assert text == expected[0], "the preempted request's text differs from its uninterrupted run"


@pytest.mark.timeout(300)
def test_the_lowest_priority_gives_way_and_comes_back_before_later_requests_of_its_priority(start_server) -> None:
    server = start_server("--parallel", "2", "--threads", "1", "--n-ctx", "8192").wait_ready()

    async def run() -> list[str]:
        order: list[str] = []
        async with AsyncClient(server.address, timeout=300) as client:
            async def one(name: str, prompt: str, priority: int, max_tokens: int) -> None:
                async for _ in client.stream(prompt, priority=priority, max_tokens=max_tokens, temperature=0):
                    streaming.add(name)
                order.append(name)

            streaming: set[str] = set()
            background = [asyncio.create_task(one("p1", "First in", 1, 8000)),
                          asyncio.create_task(one("p0", "Second in", 0, 2000))]
            while len(streaming) < 2:
                await asyncio.sleep(0.01)
            # queued behind the two running ones, then the urgent one (sent in this order on one connection);
            # "later0" can start only once "p0" is done, if "p0" resumes first: "p1" holds the other slot longer
            later = asyncio.create_task(one("later0", "A later one of priority 0", 0, 2000))
            while not sum(m.queued for m in (await client.stats()).models.values()):
                await asyncio.sleep(0.01)
            assert not order, "a request ended before the urgent one came: make them longer"
            await one("urgent", URGENT, 5, 8)
            await asyncio.gather(*background, later)
            return order

    order = asyncio.run(run())
    assert order[0] == "urgent"
    assert order.index("p0") < order.index("later0"), f"the preempted request lost its place: {order}"


@pytest.mark.timeout(600)
def test_a_preempted_request_of_the_real_model_gives_the_text_of_its_uninterrupted_run(start_server,
                                                                                        real_model) -> None:
    server = start_server("--model", real_model.path, "--parallel", "1", "--reuse", "exact", "--threads", "1",
                          "--n-ctx", "1024").wait_ready(300)
    low = {"max_tokens": 300, "temperature": 0.8, "seed": 99}
    expected = asyncio.run(_alone(server.address, low, [LOW]))
    order, streamed, stats = asyncio.run(_contend(server.address, low, {"max_tokens": 8, "temperature": 0}, [LOW]))
    assert order == ["urgent", "low0"], "the urgent request waited for the slot"
    assert stats.counters["preempted"] == 1
    assert streamed == [(expected[0], expected[0])]


@pytest.mark.timeout(300)
def test_a_parked_request_whose_instance_dies_continues_from_its_streamed_tokens(start_server) -> None:
    server = start_server("--parallel", "1", "--reuse", "exact", "--threads", "1", "--n-ctx", "4096").wait_ready()
    low = {"max_tokens": 1200, "temperature": 0}
    expected = asyncio.run(_alone(server.address, low, [LOW]))[0]

    async def run() -> tuple[str, str, Any]:
        async with AsyncClient(server.address, timeout=300) as client:
            started, urgent_started = asyncio.Event(), asyncio.Event()

            async def stream(prompt: str, priority: int, event: asyncio.Event, **params: Any) -> tuple[str, str]:
                s = client.stream(prompt, priority=priority, **params)
                chunks = []
                async for text in s:
                    chunks.append(text)
                    event.set()
                assert s.result is not None
                return "".join(chunks), s.result.text

            parked = asyncio.create_task(stream(LOW, 0, started, **low))
            await asyncio.wait_for(started.wait(), 120)
            urgent = asyncio.create_task(stream(URGENT, 10, urgent_started, max_tokens=3000, temperature=0,
                                                ignore_eos=True))
            await asyncio.wait_for(urgent_started.wait(), 120)  # the low one is parked on the worker now
            assert not parked.done()
            os.kill(server.slots()[0].pid, signal.SIGKILL)
            (chunks, text), _ = await asyncio.gather(parked, urgent)
            return chunks, text, await client.stats()

    chunks, text, stats = asyncio.run(run())
    assert stats.counters["preempted"] == 1
    assert chunks == text == expected, "the parked request did not continue exactly from its streamed tokens"


@pytest.mark.timeout(300)
def test_a_parked_request_cancelled_is_forgotten_and_its_room_serves_the_next_preemption(start_server) -> None:
    server = start_server("--parallel", "1", "--threads", "1", "--n-ctx", "4096").wait_ready()

    async def run() -> list[str]:
        order: list[str] = []
        async with AsyncClient(server.address, timeout=300) as client:
            async def one(name: str, priority: int, started: asyncio.Event, **params: Any) -> None:
                s = client.stream(f"{name}: {LOW}", priority=priority, temperature=0, request_id=name, **params)
                try:
                    async for _ in s:
                        started.set()
                    order.append(name)
                except Cancelled:
                    order.append(f"{name} cancelled")

            events = {name: asyncio.Event() for name in ("low1", "urgent1", "low2", "urgent2")}
            low1 = asyncio.create_task(one("low1", 0, events["low1"], max_tokens=2000))
            await asyncio.wait_for(events["low1"].wait(), 120)
            urgent1 = asyncio.create_task(one("urgent1", 10, events["urgent1"], max_tokens=2000, ignore_eos=True))
            await asyncio.wait_for(events["urgent1"].wait(), 120)  # low1 is parked
            await client.cancel("low1")
            await asyncio.gather(low1, urgent1)
            low2 = asyncio.create_task(one("low2", 0, events["low2"], max_tokens=2000))
            await asyncio.wait_for(events["low2"].wait(), 120)
            await one("urgent2", 10, events["urgent2"], max_tokens=8)
            await low2
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
            async with AsyncClient(server.address, timeout=300) as client:
                async def low() -> None:
                    async for _ in client.stream(LOW, max_tokens=1200, temperature=0):
                        started.set()
                    order.append("low")

                started = asyncio.Event()
                task = asyncio.create_task(low())
                await asyncio.wait_for(started.wait(), 120)
                async with httpx.AsyncClient(timeout=300) as http:
                    answer = await http.post(url, json={"model": "tiny", "prompt": URGENT, "max_tokens": 8,
                                                        "temperature": 0, "priority": 10})
                assert answer.status_code == 200, answer.text
                order.append("urgent")
                await task
            return order

        assert asyncio.run(run()) == ["urgent", "low"], "the HTTP request's priority did not reach the broker"
    finally:
        gateway.stop()
