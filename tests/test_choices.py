"""n choices of one request: run together in n slots of one instance that computes the prompt once, each
seeded seed + i, equal to n separate requests with those seeds; on the ZeroMQ path and over HTTP."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import httpx
import pytest
from conftest import ServerProcess
from engines import LONG_PROMPT
from gateway_thread import GatewayThread
from helpers import caught_mid_request, far_from_its_end, server_idle, stopped_running, wait_for

from mpserve import Client
from mpserve.errors import BadRequest
from mpserve.gateway.api.openai import OPENAI_DEFAULTS
from mpserve.wire.slots import SlotState

SAMPLED = {"temperature": 0.9, "top_k": 20, "ignore_eos": True}


@pytest.fixture(scope="module")
def four_slots() -> Iterator[ServerProcess]:
    server = ServerProcess("--instances", "1", "--parallel", "4", "--n-ctx", "1280",
                           "--reuse", "exact").wait_ready()  # choices are compared with requests of their own
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway(four_slots: ServerProcess) -> Iterator[GatewayThread]:
    gw = GatewayThread(server_name=four_slots.name)
    yield gw
    gw.stop()


@pytest.mark.timeout(180)
def test_four_choices_compute_the_prompt_once_and_equal_four_seeded_requests(four_slots: ServerProcess) -> None:
    with Client(four_slots.address, timeout=120) as client:
        choices = client.choices(LONG_PROMPT, n=4, max_tokens=12, seed=7, **SAMPLED)
        assert [c.index for c in choices] == [0, 1, 2, 3]
        n_prompt = choices[0].usage.prompt_tokens
        assert n_prompt > 900
        # the first choice computed the prompt; the others took all its cells, and its last row gave each its
        # first token
        assert choices[0].timings.cached_tokens == 0
        assert [c.timings.cached_tokens for c in choices[1:]] == [n_prompt] * 3
        assert len({c.worker for c in choices}) == 1
        alone = [client.generate(LONG_PROMPT, max_tokens=12, seed=7 + i, **SAMPLED) for i in range(4)]
        assert [c.text for c in choices] == [a.text for a in alone]
        assert len({c.text for c in choices}) > 1  # the seeds differ
        assert all(c.finish_reason == "length" and c.usage.completion_tokens == 12 for c in choices)


@pytest.mark.timeout(180)
def test_streamed_choices_come_with_their_index_and_take_four_slots_at_once(four_slots: ServerProcess) -> None:
    with Client(four_slots.address, timeout=120) as client, Client(four_slots.address) as observer:
        whole = client.choices("Hello world", n=4, max_tokens=400, seed=3, **SAMPLED)
        for _ in range(3):  # again where the choices ended before their instance was caught running them
            stream = client.stream("Hello world", n=4, max_tokens=400, seed=3, **SAMPLED)
            chunks = iter(stream)
            texts = ["", "", "", ""]
            texts[stream.chunk_index] += next(chunks)
            if (row := caught_mid_request(four_slots.slots, 400, lambda: server_idle(observer))) is not None:
                break
            list(chunks)
        else:
            pytest.fail("three times, the choices ended before their instance was caught running them")
        try:  # the rows as the instance stopped left them
            busy = sum(far_from_its_end(r, 400) for r in four_slots.slots() if r.pid == row.pid)
        finally:
            os.kill(row.pid, signal.SIGCONT)
        for text in chunks:
            texts[stream.chunk_index] += text
        assert busy == 4
        assert texts == [c.text for c in whole]
        assert [r.text for r in stream._stream.results] == texts and stream.result is not None


@pytest.mark.timeout(180)
def test_choices_wait_for_as_many_free_slots_of_one_instance(four_slots: ServerProcess) -> None:
    """While one slot runs a long request, a request for 4 choices waits: three free slots are not enough. The
    instance is stopped (SIGSTOP) once the long request has streamed, and stays stopped while the request for 4 comes
    and is queued and the slots are read, so that the long request cannot end and free the fourth meanwhile; where it
    ended before the stop could come (its row no longer busy), the whole is run again."""
    with Client(four_slots.address, timeout=120) as client:
        for _ in range(3):
            long = client.stream("Once upon a time", max_tokens=400, temperature=0, ignore_eos=True)
            chunks = iter(long)
            next(chunks)  # one slot is taken
            got: list[list[str]] = []
            waiting = threading.Thread(target=lambda got=got: got.append(
                [c.text for c in client.choices("The sea", n=4, max_tokens=4, temperature=0)]))
            instance = stopped_running(four_slots.slots, long.id, 400)
            if instance is not None:  # and it stays so until SIGCONT
                try:
                    waiting.start()
                    wait_for(lambda: client.stats().models["tiny"].queued == 1, what="the request for 4 queued")
                    rows = four_slots.slots()
                finally:
                    os.kill(instance, signal.SIGCONT)
            rest = "".join(chunks)
            assert rest and long.result is not None
            if instance is not None:
                waiting.join(60)
                assert len(got) == 1 and len(set(got[0])) == 1  # greedy: four times the same text
                assert sum(r.state is SlotState.BUSY for r in rows) == 1  # three free slots are not enough
                return
    pytest.fail("three times, the long request ended before its instance could be stopped")


@pytest.mark.timeout(60)
def test_more_choices_than_slots_are_refused_saying_how_to_configure(four_slots: ServerProcess,
                                                                     gateway: GatewayThread) -> None:
    with Client(four_slots.address) as client:
        with pytest.raises(BadRequest, match=r"'n' = 5 is more than the 4 slots .*'parallel: 5'"):
            client.choices("hi", n=5)
        with pytest.raises(BadRequest, match="'n' must be between 1 and 128"):
            client.choices("hi", n=0)
        with pytest.raises(BadRequest, match=r"ask for n with choices\(prompt, n=...\)"):
            client.generate("hi", n=2)
    for body, words in [({"n": 5}, "'n' = 5 is more than the 4 slots"),
                        ({"n": 0}, "'n' must be between 1 and 128"), ({"n": "2"}, "field 'n' must be an integer"),
                        ({"best_of": 1, "n": 0}, "'n' must be between 1 and 128"),
                        ({"best_of": 1, "n": 0, "prompt": ""}, "'n' must be between 1 and 128"),
                        ({"best_of": 1, "n": 2}, "'best_of' must be an integer from n (2) to 128"),
                        ({"best_of": 3, "stream": True}, "'best_of' cannot be used with 'stream'")]:
        answer = httpx.post(f"{gateway.url}/v1/completions", json={"model": "tiny", "prompt": "hi", **body}, timeout=10)
        assert answer.status_code == 400 and words in answer.json()["error"]["message"], body


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_openai_client_gets_n_choices(four_slots: ServerProcess, gateway: GatewayThread, stream: bool) -> None:
    oc = gateway.openai()
    with Client(four_slots.address) as client:
        expected = [c.text for c in client.choices("The quick brown fox", n=3, max_tokens=10, seed=5,
                                                   **(OPENAI_DEFAULTS | SAMPLED))]
    got = oc.completions.create(model="tiny", prompt="The quick brown fox", n=3, max_tokens=10, seed=5,
                                temperature=0.9, stream=stream, extra_body={"top_k": 20, "ignore_eos": True})
    chunks = list(got) if stream else [got]
    texts = ["", "", ""]
    finished = [None, None, None]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finished[choice.index] = choice.finish_reason or finished[choice.index]
    assert texts == expected and finished == ["length"] * 3
    if not stream:
        assert got.usage is not None and got.usage.completion_tokens == 30
    chat = oc.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=6,
                                      temperature=0.9, seed=1, stream=stream)
    contents = ["", ""]
    for chunk in (list(chat) if stream else [chat]):
        for choice in chunk.choices:
            contents[choice.index] += (choice.delta.content or "") if stream else (choice.message.content or "")
    assert all(contents)


@pytest.mark.timeout(60)
def test_cancelling_a_request_for_n_frees_all_its_slots(four_slots: ServerProcess) -> None:
    with Client(four_slots.address) as client:
        stream = client.stream("Hello", n=4, max_tokens=1000, temperature=0, ignore_eos=True)
        for _ in stream:
            break  # leaving the loop cancels the request
        wait_for(lambda: all(r.state is SlotState.IDLE for r in four_slots.slots()), what="all four slots idle")
        # a worker says idle before its answers go: the broker counts them ended once it has read those
        wait_for(lambda: client.stats().models["tiny"].running == 0, what="the broker to count none running")


@pytest.mark.timeout(120)
def test_best_of_returns_the_choices_of_the_highest_mean_logprob(four_slots: ServerProcess,
                                                                  gateway: GatewayThread) -> None:
    with Client(four_slots.address) as client:
        all_four = client.choices("Hello", n=4, max_tokens=8, seed=9, logprobs=0, **(OPENAI_DEFAULTS | SAMPLED))
    assert all_four[0].logprobs is not None
    mean = [sum(lp for _, _, lp, _ in c.logprobs.entries()) / 8 for c in all_four]  # type: ignore[union-attr]
    ranked = [all_four[i].text for i in sorted(range(4), key=lambda i: -mean[i])]
    got = gateway.openai().completions.create(model="tiny", prompt="Hello", n=2, best_of=4, max_tokens=8, seed=9,
                                              temperature=0.9, extra_body={"top_k": 20, "ignore_eos": True})
    assert [c.text for c in got.choices] == ranked[:2] and [c.index for c in got.choices] == [0, 1]
    assert all(c.logprobs is None for c in got.choices)  # asked for only to rank
    assert got.usage is not None and got.usage.completion_tokens == 32  # all four were generated
