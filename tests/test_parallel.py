"""Two instances of the bench model really compute at the same time (seen in the slot table)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
from helpers import stopped_running

from mpserve import Client
from mpserve.wire.slots import SlotState


@pytest.mark.timeout(180)
def test_two_instances_run_two_requests_at_once(start_server) -> None:
    server = start_server("--model", "builtin:bench", "--instances", "2", "--threads", "1",
                          "--n-ctx", "1024").wait_ready(120)
    overlap_samples = 0
    both_progressing = 0
    with Client(server.address) as client:
        threads = [threading.Thread(target=client.generate, args=(p,), kwargs={"max_tokens": 300, "temperature": 0})
                   for p in ("first prompt", "second prompt")]
        for t in threads:
            t.start()
        previous = None
        while any(t.is_alive() for t in threads):
            rows = server.slots()
            if all(r.state is SlotState.BUSY for r in rows):
                overlap_samples += 1
                if previous is not None and all(r.tokens > p.tokens for r, p in zip(rows, previous, strict=True)):
                    both_progressing += 1
                previous = rows
            time.sleep(0.02)
        for t in threads:
            t.join()
    rows = server.slots()
    assert [r.served for r in rows] == [1, 1]
    assert overlap_samples >= 3 and both_progressing >= 1


PROMPTS = ["Hello world", "The quick brown fox", "In the beginning", "1 2 3"]
SCENES = 5  # runs of a scene whose request ended before it could be cancelled mid-run, at most
PREAMBLE = "A long system prompt that every request of this service starts with. " * 12


async def _concurrently(address: str, prompts: list[str], **params: object) -> list:
    from mpserve import AsyncClient

    async with AsyncClient(address, timeout=60) as client:
        return await asyncio.gather(*(client.generate(p, **params) for p in prompts))


@pytest.mark.timeout(120)
def test_four_slots_of_one_instance_give_the_same_greedy_text_as_one_at_a_time(start_server) -> None:
    batched = start_server("--parallel", "4", "--reuse", "exact").wait_ready()
    single = start_server("--parallel", "1", "--reuse", "exact").wait_ready()
    params = {"max_tokens": 40, "temperature": 0}
    together = asyncio.run(_concurrently(batched.address, PROMPTS, **params))
    with Client(single.address) as client:
        alone = [client.generate(p, **params) for p in PROMPTS]
    assert [r.text for r in together] == [r.text for r in alone]
    rows = batched.slots()
    assert len(rows) == 4 and {r.worker for r in rows} == {0} and [r.slot for r in rows] == [0, 1, 2, 3]
    assert sum(r.served for r in rows) >= 4


@pytest.mark.timeout(120)
def test_requests_spread_over_instances_before_sharing_one_batch(start_server) -> None:
    server = start_server("--instances", "2", "--parallel", "4").wait_ready()
    results = asyncio.run(_concurrently(server.address, PROMPTS, max_tokens=300, temperature=0))
    workers = sorted(r.worker for r in results)
    assert workers == ["w0", "w0", "w1", "w1"], workers


@pytest.mark.timeout(120)
def test_a_shared_prefix_goes_where_a_busy_slot_holds_it_and_is_copied(start_server) -> None:
    server = start_server("--instances", "2", "--parallel", "2").wait_ready()
    with Client(server.address) as client:
        holder = client.stream(PREAMBLE + "First?", max_tokens=1500, temperature=0)
        chunks = iter(holder)
        next(chunks)  # running: its slot holds the preamble's cells
        second = client.generate(PREAMBLE + "Second?", max_tokens=8, temperature=0)
        for _ in chunks:
            pass
    assert holder.result is not None
    # the other instance was idle, but this one could copy the cells instead of computing them
    assert second.worker == holder.result.worker
    assert second.timings.cached_tokens > second.usage.prompt_tokens // 2


@pytest.mark.timeout(120)
def test_a_repeated_long_prompt_reuses_the_cached_prefix(start_server) -> None:
    server = start_server("--parallel", "2", "--n-ctx", "1024", "--reuse", "exact").wait_ready()  # whole chunks
    with Client(server.address) as client:
        first, second = (client.generate(PREAMBLE + ending, max_tokens=4, temperature=0)
                         for ending in ("First?", "Second?"))
    assert first.timings.cached_tokens == 0
    assert second.timings.cached_tokens > first.usage.prompt_tokens // 2


@pytest.mark.timeout(120)
def test_cancelling_one_of_four_sequences_leaves_the_others_unchanged(start_server) -> None:
    from mpserve import AsyncClient
    from mpserve.errors import Cancelled

    server = start_server("--parallel", "4", "--n-ctx", "2048", "--reuse", "exact").wait_ready()
    params = {"max_tokens": 300, "temperature": 0}
    expected = asyncio.run(_concurrently(server.address, PROMPTS[1:], **params))

    async def run() -> list:
        async with AsyncClient(server.address, timeout=60) as client:
            for _ in range(SCENES):  # again where the victim had ended before it could be cancelled mid-run
                victim = client.stream(PROMPTS[0], max_tokens=1500, temperature=0, ignore_eos=True)
                chunks = victim.__aiter__()
                await chunks.__anext__()
                others = [asyncio.ensure_future(client.generate(p, **params)) for p in PROMPTS[1:]]
                while sum(r.state is SlotState.BUSY for r in server.slots()) < 2 and not any(o.done() for o in others):
                    await asyncio.sleep(0.002)  # until another sequence decodes beside the victim
                if await _cancelled_mid_run(server, client, victim.id, 1500):
                    with pytest.raises(Cancelled):
                        async for _ in chunks:
                            pass
                    return await asyncio.gather(*others)
                async for _ in chunks:
                    pass
                await asyncio.gather(*others)
            pytest.fail(f"in each of {SCENES} runs the victim ended before it could be cancelled mid-run")

    results = asyncio.run(run())
    assert [r.text for r in results] == [r.text for r in expected]


async def _cancelled_mid_run(server, client, request_id: str, total: int) -> bool:
    """Cancel request ``request_id`` with the server's one instance stopped (SIGSTOP) while it runs the request far
    from its end (``far_from_its_end``); the instance goes on once the broker took the CANCEL, which then waits on the
    worker's link: the request is cancelled mid-run for certain. False, nothing cancelled, where it was not running
    so."""
    pid = await asyncio.to_thread(stopped_running, server.slots, request_id, total)
    if pid is None:
        return False
    try:
        await client.cancel(request_id)
        await client.stats()  # answered after the CANCEL was taken
        return True
    finally:
        os.kill(pid, signal.SIGCONT)
