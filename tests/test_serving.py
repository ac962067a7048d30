"""End to end through a real server: real processes, real sockets, the real tiny GGUF model."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import llama_cpp
import pytest
import zmq
from helpers import caught_mid_request, dealer, raw_request, received

from mpserve import AsyncClient, Client
from mpserve.errors import BadRequest, Busy, Cancelled, ConnectionFailed, Timeout, UnknownModel
from mpserve.wire import protocol as wire
from mpserve.wire.slots import SlotState

PROMPTS = ["Hello world", "The quick brown fox", "In the beginning", "1 2 3"]


@pytest.fixture(scope="module")
def direct(tiny_model_path: str) -> llama_cpp.Llama:
    return llama_cpp.Llama(tiny_model_path, n_ctx=2048, n_threads=1, flash_attn=True, verbose=False)  # = auto


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_greedy_output_equals_a_direct_llama_cpp_call(tiny_server, direct, stream: bool) -> None:
    with Client(tiny_server.address) as client:
        for prompt in PROMPTS:
            expected = direct.create_completion(prompt, max_tokens=24, temperature=0, seed=1)
            if stream:
                s = client.stream(prompt, max_tokens=24, temperature=0, seed=1)
                text = "".join(s)
                assert s.result is not None and s.result.text == text
            else:
                result = client.generate(prompt, max_tokens=24, temperature=0, seed=1)
                text = result.text
                assert result.usage.completion_tokens == expected["usage"]["completion_tokens"]
                assert result.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
            assert text == expected["choices"][0]["text"]


@pytest.mark.timeout(60)
def test_seeded_sampling_is_reproducible_and_stop_strings_apply(tiny_server, direct) -> None:
    with Client(tiny_server.address) as client:
        a = client.generate("Once upon", max_tokens=30, temperature=1.0, seed=42)
        b = client.generate("Once upon", max_tokens=30, temperature=1.0, seed=42)
        assert a.text == b.text
        stop = a.text[10:12]
        stopped = client.generate("Once upon", max_tokens=30, temperature=1.0, seed=42, stop=[stop])
        assert stopped.finish_reason == "stop"
        assert stopped.text == a.text[: a.text.index(stop)]


@pytest.mark.timeout(60)
def test_many_concurrent_requests_share_one_async_connection(tiny_server) -> None:
    async def main() -> list[str]:
        async with AsyncClient(tiny_server.address) as client:
            results = await asyncio.gather(*(client.generate(p, max_tokens=16, temperature=0)
                                             for p in PROMPTS * 8))
            return [r.text for r in results]

    texts = asyncio.run(main())
    assert texts == texts[: len(PROMPTS)] * 8  # same prompt, same greedy text, whichever worker ran it


@pytest.mark.timeout(60)
def test_sync_client_is_usable_from_many_threads(tiny_server) -> None:
    results: dict[int, str] = {}
    with Client(tiny_server.address) as client:
        def run(i: int) -> None:
            results[i] = client.generate(PROMPTS[i % 4], max_tokens=8, temperature=0).text

        threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(results) == 12 and all(results[i] == results[i % 4] for i in results)


@pytest.mark.timeout(60)
def test_unknown_model_is_refused_with_the_served_models(tiny_server) -> None:
    with Client(tiny_server.address) as client, pytest.raises(UnknownModel) as err:
        client.generate("hi", model="nope")
    assert "nope" in err.value.message and "tiny" in err.value.message


@pytest.mark.timeout(60)
def test_bad_parameters_are_refused_by_client_and_by_server(tiny_server) -> None:
    with Client(tiny_server.address) as client:
        with pytest.raises(BadRequest, match="max_tokens"):
            client.generate("hi", max_tokens=-1)
    cases = {
        "neg": {"max_tokens": -5},
        "type": {"max_tokens": "ten"},
        "temp": {"temperature": "hot"},
        "unknown": {"mirostat": 2},
    }
    with dealer(tiny_server.address) as sock:
        for rid, params in cases.items():
            sock.send_multipart(raw_request({"id": rid, "prompt": "hi", "params": params}))
        answers = {err.id: err for err in (received(sock) for _ in cases)}
    assert all(isinstance(e, wire.Error) for e in answers.values()), answers
    assert {e.code for e in answers.values()} == {"bad_request"}
    assert "max_tokens" in answers["neg"].message and "integer" in answers["type"].message
    assert "mirostat" in answers["unknown"].message


@pytest.mark.timeout(60)
def test_prompt_longer_than_the_context_is_a_bad_request(start_server) -> None:
    server = start_server("--n-ctx", "64").wait_ready()
    with Client(server.address) as client, pytest.raises(BadRequest, match="context"):
        client.generate("word " * 200, max_tokens=4)
    with Client(server.address) as client:  # and the instance is fine afterwards
        assert client.generate("hi", max_tokens=4, temperature=0).usage.completion_tokens == 4


@pytest.mark.timeout(60)
def test_full_queue_answers_busy_with_a_retry_hint(start_server) -> None:
    server = start_server("--instances", "1", "--max-queue", "1", "--n-ctx", "4096").wait_ready()

    async def main() -> list[object]:
        async with AsyncClient(server.address) as client:
            running = client.stream("a", max_tokens=3000, temperature=0, timeout=30)
            chunks = running.__aiter__()
            await chunks.__anext__()  # the only instance is busy now
            requests = [asyncio.ensure_future(client.generate("b", max_tokens=4, timeout=30)) for _ in range(3)]
            await asyncio.wait(requests, timeout=0.5)  # one queues, the others find the queue full
            await client.cancel(running.id)
            with pytest.raises(Cancelled):
                async for _ in chunks:
                    pass
            return await asyncio.gather(*requests, return_exceptions=True)

    outcomes = asyncio.run(main())
    busy = [o for o in outcomes if isinstance(o, Busy)]
    done = [o for o in outcomes if not isinstance(o, BaseException)]
    assert len(done) == 1 and len(busy) == 2, outcomes
    assert all(b.retry_after and 0 < b.retry_after <= 30 for b in busy)


@pytest.mark.timeout(60)
def test_the_bounds_on_one_clients_requests_and_on_all_waiting_requests_answer_busy(start_server) -> None:
    """With max_pending_per_client 2 and max_queue_total 2, behind a request that keeps the only instance
    busy: a client's third request is refused busy naming its bound, while another client's request still
    queues; the next request, of a client under its own bound, is refused busy naming the server's. A refusal
    is its request's one answer, with a retry hint; the requests taken all end DONE."""
    server = start_server("--instances", "1", "--n-ctx", "4096", "--max-pending-per-client", "2",
                          "--max-queue-total", "2").wait_ready()

    def request(rid: str, stream: bool = False) -> list[bytes]:
        return raw_request({"id": rid, "prompt": rid, "stream": stream, "params": {"max_tokens": 1000,
                                                                                  "temperature": 0}})

    ends: dict[str, list[object]] = {}

    def until(sock: zmq.Socket[bytes], rid: str) -> None:
        """Read what ``sock`` receives until request ``rid`` has ended, noting every request's ends."""
        while rid not in ends:
            if isinstance(message := received(sock, 30), (wire.Done, wire.Error)):
                ends.setdefault(message.id, []).append(message)

    with dealer(server.address) as a, dealer(server.address) as b:
        a.send_multipart(request("a1", stream=True))
        assert isinstance(received(a, 30), wire.Chunk)  # the only instance is busy with a1
        for sock, first, second in ((a, "a2", "a3"), (b, "b1", "b2")):  # one socket's requests come in order
            sock.send_multipart(request(first))  # queues
            sock.send_multipart(request(second))
            until(sock, second)
        for sock, rid in ((a, "a1"), (a, "a2"), (b, "b1")):
            until(sock, rid)
        assert not a.poll(200) and not b.poll(0), "more than one answer to a request"
    assert {rid for rid, [end] in ends.items() if isinstance(end, wire.Done)} == {"a1", "a2", "b1"}, ends
    [per_client], [total] = ends["a3"], ends["b2"]
    assert per_client.code == total.code == "busy" and per_client.retry_after and total.retry_after
    assert "you have 2 requests pending, the most one client may have" in per_client.message
    assert "the server has 2 requests waiting" in total.message


@pytest.mark.timeout(60)
def test_cancel_and_timeout_end_requests_and_free_the_instance(start_server) -> None:
    server = start_server("--instances", "1", "--n-ctx", "8192").wait_ready()

    async def main() -> None:
        async with AsyncClient(server.address) as client:
            with pytest.raises(Timeout):
                await client.generate("x", max_tokens=8000, temperature=0, timeout=0.3)
            stream = client.stream("y", max_tokens=8000, temperature=0)
            chunks = stream.__aiter__()
            await chunks.__anext__()
            await client.cancel(stream.id)
            with pytest.raises(Cancelled):
                async for _ in chunks:
                    pass
            # the single instance is free again: a short request completes promptly
            result = await client.generate("z", max_tokens=4, temperature=0, timeout=10)
            assert result.usage.completion_tokens == 4

    asyncio.run(main())
    rows = server.slots()
    assert rows[0].state is SlotState.IDLE and rows[0].served == 3


@pytest.mark.timeout(60)
def test_client_of_a_stopped_server_gets_a_connection_error(start_server) -> None:
    server = start_server().wait_ready()
    address = server.address
    client = Client(address)
    server.stop()
    started = time.monotonic()
    with pytest.raises(ConnectionFailed):
        client.generate("hi", max_tokens=4, timeout=10)
    assert time.monotonic() - started < 10
    client.close()
    with pytest.raises(ConnectionFailed, match="mpserve start"):
        Client(address, connect_timeout=1)


@pytest.mark.timeout(60)
def test_sigterm_finishes_in_flight_requests_then_removes_its_files(start_server) -> None:
    server = start_server("--instances", "1", "--n-ctx", "4096").wait_ready()
    info = server.info
    results: list[object] = []
    with Client(server.address) as client:
        def run() -> None:
            try:
                results.append(client.generate("a", max_tokens=500, temperature=0))
            except Exception as exc:  # reported by the assertion below
                results.append(exc)

        t = threading.Thread(target=run)
        t.start()
        while server.slots()[0].state is not SlotState.BUSY:
            time.sleep(0.01)
        server.proc.send_signal(15)
        t.join(30)
    assert server.proc.wait(30) == 0  # by itself: a second SIGTERM after its files are gone would end it at once
    server.stop()
    assert results and not isinstance(results[0], Exception), (results, server.log)
    assert results[0].usage.completion_tokens == 500  # type: ignore[union-attr]
    from pathlib import Path

    assert not Path(info.slots).exists() and not Path(info.front[len("ipc://"):]).exists()
    assert not server.tracebacks()


@pytest.mark.timeout(60)
def test_stats_count_what_happened(start_server) -> None:
    server = start_server("--instances", "2").wait_ready()
    with Client(server.address) as client:
        for _ in range(3):
            client.generate("hi", max_tokens=4)
        with pytest.raises(UnknownModel):
            client.generate("hi", model="nope")
        stats = client.stats()
    assert stats.accepting and stats.counters["accepted"] == 3 and stats.counters["done"] == 3
    assert stats.counters["rejected_unknown_model"] == 1
    scaling = wire.ModelScaling(min=2, max=2, ceiling=2, settings="builtin:tiny, n_ctx 2048, parallel 1, KV f16/f16")
    assert stats.models["tiny"] == wire.ModelStats(queued=0, running=0, instances=2, free_slots=2, scaling=scaling)


@pytest.mark.timeout(60)
def test_stats_tell_how_long_the_head_of_a_queue_has_waited(start_server) -> None:
    server = start_server("--instances", "1", "--n-ctx", "4096").wait_ready()

    async def run() -> tuple[wire.Stats, wire.Stats]:
        async with AsyncClient(server.address, timeout=60) as client:
            holder = asyncio.create_task(client.generate("hold the slot", max_tokens=3000, temperature=0,
                                                         ignore_eos=True))
            # its instance stopped while it holds the slot, so that the slot stays taken while the other waits
            row = await asyncio.to_thread(caught_mid_request, server.slots, 3000, holder.done)
            assert row is not None, "the slot's holder ended before its instance was caught running it"
            try:
                waiter = asyncio.create_task(client.generate("wait", max_tokens=4))
                while (await client.stats()).models["tiny"].queued == 0:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.3)  # not a wait: the queued request's wait, which is measured
                waiting = await client.stats()
                holder.cancel()
            finally:
                os.kill(row.pid, signal.SIGCONT)
            await asyncio.gather(holder, waiter, return_exceptions=True)
            return waiting, await client.stats()

    waiting, after = asyncio.run(run())
    assert waiting.models["tiny"].queued == 1 and waiting.models["tiny"].oldest_wait_s >= 0.3
    assert after.models["tiny"].queued == 0 and after.models["tiny"].oldest_wait_s == 0.0
