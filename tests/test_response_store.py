"""The Responses API's stored responses are bounded in bytes, per API key and in all, the oldest going first, and
the journaled events of a key's streams count in them: a real gateway in front of the echo backend, whose answers
are as large as their prompts."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from gateway_thread import GatewayThread
from helpers import wait_for

from mpserve.gateway.api.response_store import StoreBudget

pytestmark = pytest.mark.timeout(60)

ENTRY_CHARS = 10_000  # a stored response holds its input, and the echo of it twice (its output, its conversation)
BUDGET = StoreBudget(total=250_000, per_key=110_000)  # three such responses per key, eight in all
KEYS = ("key-a", "key-b", "key-c", "key-d")


@pytest.fixture
def store(start_server) -> Iterator[GatewayThread]:
    server = start_server("--model", "echo").wait_ready()
    gateway = GatewayThread(server_name=server.name, api_keys=KEYS, responses=BUDGET)
    yield gateway
    gateway.stop()


def _stored(gateway: GatewayThread, key: str, chars: int = ENTRY_CHARS) -> str:
    answer = httpx.post(f"{gateway.url}/v1/responses", headers={"authorization": f"Bearer {key}"}, timeout=30,
                        json={"model": "echo", "input": "x" * chars, "max_output_tokens": 2})
    assert answer.status_code == 200, answer.text
    response_id: str = answer.json()["id"]
    return response_id


def _kept(gateway: GatewayThread, key: str, response_id: str) -> bool:
    answer = httpx.get(f"{gateway.url}/v1/responses/{response_id}", headers={"authorization": f"Bearer {key}"},
                       timeout=10)
    assert answer.status_code in (200, 404), answer.text
    if answer.status_code == 404:
        assert f"at most {BUDGET.per_key} bytes of them per API key and {BUDGET.total} in all" in answer.text
    return answer.status_code == 200


def test_a_key_keeps_its_newest_responses_within_its_bytes(store: GatewayThread) -> None:
    ids = [_stored(store, "key-a") for _ in range(4)]
    assert [_kept(store, "key-a", i) for i in ids] == [False, True, True, True]  # four would be over 110 kB
    too_large = _stored(store, "key-a", BUDGET.per_key // 2)
    assert not _kept(store, "key-a", too_large)  # not kept, and it took nothing else with it
    assert [_kept(store, "key-a", i) for i in ids[1:]] == [True, True, True]


def test_the_oldest_response_of_any_key_goes_first_past_the_total(store: GatewayThread) -> None:
    first = {key: [_stored(store, key) for _ in range(2)] for key in KEYS[:3]}  # six: within the total
    assert all(_kept(store, key, i) for key, ids in first.items() for i in ids)
    newest = [_stored(store, "key-d") for _ in range(3)]  # nine: over it
    assert not _kept(store, "key-a", first["key-a"][0])  # the oldest of all
    assert all(_kept(store, "key-d", i) for i in newest)
    assert _kept(store, "key-c", first["key-c"][1])


def _background(gateway: GatewayThread, key: str) -> str:
    """A background response of ``key`` to an input of ENTRY_CHARS, run to its end: stored (about 31 kB), and
    journaled (its events, about 54 kB, and its request: about 75 kB)."""
    headers = {"authorization": f"Bearer {key}"}
    answer = httpx.post(f"{gateway.url}/v1/responses", headers=headers, timeout=30, json={
        "model": "echo", "input": "x " * (ENTRY_CHARS // 2), "max_output_tokens": 2, "background": True})
    assert answer.status_code == 200, answer.text
    url = f"{gateway.url}/v1/responses/{answer.json()['id']}"
    wait_for(lambda: httpx.get(url, headers=headers, timeout=10).json()["status"] == "incomplete", 30, "its end")
    return url


def test_a_keys_journaled_streams_count_in_its_bytes_and_go_before_its_responses(store: GatewayThread) -> None:
    headers = {"authorization": "Bearer key-a"}

    def streamed(url: str) -> int:
        return httpx.get(url, headers=headers, params={"stream": "true"}, timeout=10).status_code

    first = _background(store, "key-a")
    assert streamed(first) == 200  # stored and journaled: about 106 kB of the 110
    second = _background(store, "key-a")
    assert streamed(first) == streamed(second) == 404  # both streams' events would be over: they went, oldest first
    assert all(httpx.get(url, headers=headers, timeout=10).status_code == 200 for url in (first, second))
