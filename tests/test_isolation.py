"""Tenants kept apart on one gateway with two API keys, in front of real servers: the prefix cache is no oracle
of another key's prompts (``cached_tokens`` is the same for a right and a wrong guess; a shared ``cache_salt``
shares again), each request carries one key header, request ids are per key, and the console and the monitor
show a key its own requests only (the admin key sees them all)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import ServerProcess
from gateway_thread import GatewayThread
from helpers import config_file, wait_for

from mpserve.gateway.api.response_store import StoreBudget

pytestmark = pytest.mark.timeout(120)

KEY_A, KEY_B, ADMIN = "key-of-tenant-a", "key-of-tenant-b", "key-of-the-admin"
PREAMBLE = " ".join(f"Clause {i}: the parties agree that the terms of this memo stay confidential until the "
                    "closing, and that any question goes to counsel first." for i in range(40))


def memo(price: int, preamble: str = PREAMBLE) -> str:
    return f"{preamble} The offer closes on 12 March at {price} dollars per share. Reply with OK."


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def tiny() -> Iterator[GatewayThread]:
    """One instance of the built-in model with two slots (and the host store), behind two keys."""
    server = ServerProcess("--instances", "1", "--parallel", "2", "--n-ctx", "4096").wait_ready()
    gw = GatewayThread(server_name=server.name, api_keys=(KEY_A, KEY_B), admin_key=ADMIN)
    yield gw
    gw.stop()
    assert not server.tracebacks()
    server.stop()


def cached(gw: GatewayThread, key: str, prompt: str, **extra: Any) -> int:
    answer = httpx.post(f"{gw.url}/v1/completions", headers=auth(key), timeout=60,
                        json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra})
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert usage["prompt_tokens"] > 512  # more than a prompt chunk: the host store keeps what a slot loses
    count: int = usage["prompt_tokens_details"]["cached_tokens"]
    return count


def test_another_keys_prompt_is_no_oracle_a_right_guess_caches_what_a_wrong_one_does(tiny: GatewayThread) -> None:
    cached(tiny, KEY_B, memo(41))  # the secret
    cached(tiny, KEY_A, memo(37))  # A's own first guess: what A's next guesses may start from
    wrong, right = cached(tiny, KEY_A, memo(29)), cached(tiny, KEY_A, memo(41))
    assert wrong > 0 and right == wrong  # both reuse A's own guess up to the number, nothing of B's memo
    assert cached(tiny, KEY_B, memo(41)) > right  # B's own memo is still cached for B


def test_a_cache_salt_both_keys_name_shares_again(tiny: GatewayThread) -> None:
    preamble = "Shared. " + PREAMBLE
    salt = {"cache_salt": "deal-room-7"}
    cached(tiny, KEY_B, memo(41, preamble), **salt)
    cached(tiny, KEY_A, memo(37, preamble), **salt)
    wrong, right = cached(tiny, KEY_A, memo(29, preamble), **salt), cached(tiny, KEY_A, memo(41, preamble), **salt)
    assert right > wrong  # under one salt, B's memo is A's to reuse: the right guess reuses all of it


def test_a_cache_salt_is_checked(tiny: GatewayThread) -> None:
    for bad in ("", "x" * 257, 7):
        answer = httpx.post(f"{tiny.url}/v1/completions", headers=auth(KEY_A), timeout=30,
                            json={"model": "tiny", "prompt": "hi", "max_tokens": 1, "cache_salt": bad})
        assert answer.status_code == 400 and "'cache_salt' must be" in answer.json()["error"]["message"]


@pytest.fixture(scope="module")
def echo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, GatewayThread]]:
    """The echo backend at 50 ms a token (a request of 100 tokens runs 5 s), two slots, behind two keys."""
    config = config_file(tmp_path_factory.mktemp("echo"), "echo", models=[
        {"name": "echo", "path": "echo", "parallel": 2, "echo_tick_ms": 50}])
    server = ServerProcess("--config", config).wait_ready()
    gw = GatewayThread(server_name=server.name, api_keys=(KEY_A, KEY_B), admin_key=ADMIN,
                       responses=StoreBudget(total=100_000, per_key=50_000))
    yield server, gw
    gw.stop()
    server.stop()


def slow(gw: GatewayThread, key: str, request_id: str, answers: list[httpx.Response]) -> threading.Thread:
    """A request of 100 tokens (5 s) under ``request_id``, in a thread; its answer goes into ``answers``."""
    def run() -> None:
        answers.append(httpx.post(f"{gw.url}/v1/completions", timeout=60, headers={**auth(key),
                                  "X-Request-Id": request_id}, json={"model": "echo", "prompt": "x",
                                                                     "max_tokens": 100}))
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_request_ids_are_per_key_and_the_views_show_a_key_its_own(echo: tuple[ServerProcess, GatewayThread]) -> None:
    server, gw = echo
    answers: list[httpx.Response] = []
    first = slow(gw, KEY_B, "job-1", answers)
    wait_for(lambda: any(r.request.endswith("job-1") for r in server.slots()), 10, "B's request running")
    second = slow(gw, KEY_A, "job-1", answers)  # A reuses B's id: neither refused nor told that B's is pending
    wait_for(lambda: sum(r.request.endswith("job-1") for r in server.slots()) == 2, 10, "both running")

    def requests(path: str, key: str) -> list[Any]:
        body = gw.get(path, headers=auth(key)).json()
        slots = body["slots"] if path == "/console/state" else [s for i in body["instances"] for s in i["slots"]]
        return sorted(((s["request"], s["tokens"] is not None) for s in slots if s["state"] == "busy"), key=str)

    for path in ("/console/state", "/backend/monitor"):
        assert requests(path, KEY_A) == [("job-1", True), (None, False)]  # its own id; of B's, only that it runs
        assert requests(path, KEY_B) == [("job-1", True), (None, False)]
        shown = [r for r, _ in requests(path, ADMIN)]
        assert len(shown) == 2 and all(r.endswith("/job-1") for r in shown) and shown[0] != shown[1]
    first.join()
    second.join()
    assert [(a.status_code, a.headers["x-request-id"]) for a in answers] == [(200, "job-1")] * 2


def test_a_request_carries_one_key_header_so_no_key_fills_another_keys_store(
        echo: tuple[ServerProcess, GatewayThread]) -> None:
    """The reported attack: key A's requests, each with a second Authorization header naming a made-up owner
    first, stored responses outside A's share (the key check read the last header, the store the first) until
    B's response was evicted."""
    _, gw = echo
    body = {"model": "echo", "input": "x" * 10_000, "max_output_tokens": 2}
    kept = httpx.post(f"{gw.url}/v1/responses", headers=auth(KEY_B), json=body, timeout=30)
    assert kept.status_code == 200, kept.text
    response = f"{gw.url}/v1/responses/{kept.json()['id']}"
    sent = [httpx.post(f"{gw.url}/v1/responses", json=body, timeout=30, headers=[
        ("authorization", f"Bearer owner-{i}"), ("authorization", f"Bearer {KEY_A}")]) for i in range(16)]
    assert httpx.get(response, headers=auth(KEY_B), timeout=10).status_code == 200  # B's response is still there
    for refused in sent:
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "bad_request", refused.text
        assert "exactly one" in refused.json()["error"]["message"]
    both = httpx.get(response, timeout=10, headers=[("authorization", f"Bearer {KEY_B}"), ("x-api-key", KEY_B)])
    assert both.status_code == 400
    assert httpx.get(response, headers={"x-api-key": KEY_B}, timeout=10).status_code == 200
    assert httpx.get(response, headers=auth(KEY_A), timeout=10).status_code == 404
