"""Tenants on a real server: the order their queued requests start in (priority, then weighted fair shares), their
limits (refused, naming the limit), the pending cap per tenant the gateway names, and their figures in STATS; over
HTTP, a tenant is an API key and a refusal for its limits is a 429 with Retry-After, while other keys are served.

One instance of the echo backend with a clock (``echo_tick_ms``), mostly with one slot: with one slot, requests end
in the order they started. A long request holds the slot while the others queue; then they run one by one. The
servers behind a gateway, and the one on CURVE, have two slots, one left for another tenant.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import zmq.auth
from conftest import ServerProcess
from helpers import config_file, free_port, http_up, mpserve, wait_for

from mpserve import AsyncClient, Client
from mpserve.errors import Busy, Forbidden
from mpserve.wire.messages import Stats

pytestmark = pytest.mark.timeout(90)

KEY_A = "key:" + "a" * 16
KEY_B = "key:" + "b" * 16
KEY_C = "key:" + "c" * 16
API_KEYS = ("first-key", "second-key", "third-key")  # the keys of a gateway (_keyed_gateway)
ADMIN_KEY = "operator-key"  # the gateway's --admin-key (_keyed_gateway)
FIRST, SECOND, THIRD = ("key:" + hashlib.sha256(key.encode()).hexdigest()[:16] for key in API_KEYS)  # their tenants
TICK_MS = 5
HOLD_TOKENS = 400  # the request that holds the slot: about 2 s
PENDING = 10  # max_pending_per_client


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("tenants")
    config = config_file(Path(tmp), "tenants", max_pending_per_client=PENDING, models=[
        {"name": "echo", "path": "echo", "echo_tick_ms": TICK_MS, "instances": 1, "parallel": 1}], tenants={
        KEY_A: {"weight": 1}, KEY_B: {"weight": 3, "max_priority": 10},
        KEY_C: {"max_running": 1, "max_queued": 1, "tokens_per_minute": 60}, "local": {"max_priority": 100}})
    proc = ServerProcess("--config", config).wait_ready()
    yield proc
    proc.stop()
    assert not proc.tracebacks(), "\n".join(proc.log)


async def _order_behind_a_hold(address: str, requests: list[tuple[str, str, int]]) -> list[str]:
    """Hold the one slot, queue ``requests`` (tenant, label, priority) in this order, and return their labels in
    the order they ended (with one slot: the order they started)."""
    ended: list[str] = []
    async with AsyncClient(address, timeout=60) as client:
        hold = asyncio.ensure_future(client.generate("x" * HOLD_TOKENS, max_tokens=HOLD_TOKENS, priority=100))  # no
        # request waits above it: none preempts it (tests/test_preemption.py), so the queue's order shows alone
        await _until_running(client)

        async def one(tenant: str, label: str, priority: int) -> None:
            await client.generate(label, max_tokens=2, tenant=tenant, priority=priority)
            ended.append(label)

        queued = [asyncio.ensure_future(one(*r)) for r in requests]
        await hold
        await asyncio.gather(*queued)
    return ended


async def _until(client: AsyncClient, what: str, check: Callable[[Stats], bool]) -> None:
    deadline = time.monotonic() + 10
    while not check(await client.stats()):
        assert time.monotonic() < deadline, f"not within 10 s: {what}"
        await asyncio.sleep(0.01)


async def _until_queued(client: AsyncClient, tenant: str, count: int) -> None:
    """Until ``count`` requests of ``tenant`` wait in the broker's queue: it has them all."""
    await _until(client, f"{count} requests of {tenant} queued",
                 lambda s: tenant in s.tenants and s.tenants[tenant].queued >= count)


async def _until_running(client: AsyncClient) -> None:
    await _until(client, "the holding request running", lambda s: s.models["echo"].running > 0)


def test_a_tenant_of_weight_three_starts_three_requests_for_one_of_weight_one(server: ServerProcess) -> None:
    requests = [(KEY_A, f"a{i}", 0) for i in range(8)] + [(KEY_B, f"b{i}", 0) for i in range(8)]  # a's came first
    ended = asyncio.run(_order_behind_a_hold(server.admin, requests))
    assert sorted(ended) == sorted(label for _, label, _ in requests)
    first = [label[0] for label in ended[:8]]
    assert 5 <= first.count("b") <= 7, ended  # 3 : 1 while both wait (6 : 2); FIFO would start a's 8 first
    assert [x for x in ended if x[0] == "a"] == [f"a{i}" for i in range(8)]  # a tenant's own: in order


def test_priority_goes_first_but_only_up_to_the_tenants_ceiling(server: ServerProcess) -> None:
    requests = [(KEY_A, "a0", 0), (KEY_A, "a1", 0), (KEY_A, "a-urgent", 50), (KEY_B, "b-urgent", 10),
                ("", "local-urgent", 20)]
    ended = asyncio.run(_order_behind_a_hold(server.admin, requests))
    # local's ceiling is 100, b's 10; a's is 0, so its 50 counts as 0 and waits its turn
    assert ended == ["local-urgent", "b-urgent", "a0", "a1", "a-urgent"]


def test_without_a_tenants_section_a_key_cannot_jump_the_queue_by_asking(tmp_path: Path) -> None:
    """No ``tenants`` section: a keyed tenant's priority 100 counts as 0 (it waits behind another key's request
    that came first), the local user's 20 still counts, and the server warns once, naming the tenant."""
    config = config_file(tmp_path, "untenanted", models=[
        {"name": "echo", "path": "echo", "echo_tick_ms": TICK_MS, "instances": 1, "parallel": 1}])
    proc = ServerProcess("--config", config).wait_ready()
    try:
        requests = [(KEY_A, "a0", 0), (KEY_B, "b-urgent", 100), ("", "local-urgent", 20)]
        ended = asyncio.run(_order_behind_a_hold(proc.admin, requests))
        assert ended[0] == "local-urgent" and ended.index("a0") < ended.index("b-urgent"), ended
        wait_for(lambda: any(f"tenant {KEY_B} asked for priority 100, lowered to 0" in line for line in proc.log),
                 what="the warning")
    finally:
        proc.stop()
    assert not proc.tracebacks(), "\n".join(proc.log)


def test_limits_refuse_naming_the_limit_its_value_and_the_use(server: ServerProcess) -> None:
    async def run() -> None:
        async with AsyncClient(server.admin, timeout=60) as client:
            hold = asyncio.ensure_future(client.generate("x" * HOLD_TOKENS, max_tokens=HOLD_TOKENS, tenant=KEY_C))
            await _until_running(client)
            queued = asyncio.ensure_future(client.generate("q", max_tokens=2, tenant=KEY_C))
            await _until_queued(client, KEY_C, 1)
            with pytest.raises(Busy, match=rf"tenant {KEY_C} has 1 request queued, its max_queued \(1\), and 1 "
                                           r"running, its max_running 1") as refused:
                await client.generate("over", max_tokens=2, tenant=KEY_C)
            assert refused.value.retry_after
            await client.generate("other", max_tokens=2, tenant=KEY_A)  # another tenant passes it
            await hold
            await queued
            with pytest.raises(Busy, match=rf"tenant {KEY_C} has used \d+ tokens \(prompt and generated\) in the "
                                           r"last 60 s, its tokens_per_minute \(60\)") as refused:
                await client.generate("more", max_tokens=2, tenant=KEY_C)
            assert 0 < (refused.value.retry_after or 0) <= 60
            figures = (await client.stats()).tenants[KEY_C]
            assert figures.refusals == 2 and figures.requests == 2 and figures.generated_tokens == HOLD_TOKENS + 2
            assert figures.queue_s > 0 and figures.running == figures.queued == 0

    asyncio.run(run())


def test_the_pending_cap_counts_each_tenant_the_gateway_names_apart(server: ServerProcess) -> None:
    async def run() -> None:
        async with AsyncClient(server.admin, timeout=60) as client:
            hold = asyncio.ensure_future(client.generate("x" * HOLD_TOKENS, max_tokens=HOLD_TOKENS, tenant=KEY_A))
            await _until_running(client)
            filling = [asyncio.ensure_future(client.generate("f", max_tokens=2, tenant=KEY_A))
                       for _ in range(PENDING - 1)]
            await _until_queued(client, KEY_A, PENDING - 1)
            with pytest.raises(Busy, match=rf"tenant {KEY_A} has {PENDING} requests pending, the most one client"):
                await client.generate("over", max_tokens=2, tenant=KEY_A)
            assert (await client.generate("b", max_tokens=2, tenant=KEY_B)).text  # not refused for a's
            await asyncio.gather(hold, *filling)

    asyncio.run(run())


def test_a_client_socket_request_is_its_connections_and_names_no_other_tenant(server: ServerProcess) -> None:
    with Client(server.address, timeout=30) as client:
        with pytest.raises(Forbidden, match="'tenant' is named only over the server's admin socket"):
            client.generate("hi", max_tokens=2, tenant=KEY_B)
        assert client.generate("hi", max_tokens=2, priority=100).text  # local's ceiling is 100
        wait_for(lambda: client.stats().tenants.get("local", None), 5, "the local tenant's figures")
        assert client.stats().tenants["local"].requests >= 1


@contextmanager
def _keyed_gateway(tmp_path: Path, **config: object) -> Iterator[tuple[ServerProcess, str]]:
    """A server of ``config`` (one instance of the echo backend, two slots) with a gateway whose API keys are
    ``API_KEYS`` and whose admin key is ``ADMIN_KEY``: the server and the gateway's URL."""
    port = free_port()
    keys = tmp_path / "keys"
    keys.write_text("\n".join(API_KEYS) + "\n")
    keys.chmod(0o600)  # a key file others may read is refused
    path = config_file(tmp_path, "http", models=[
        {"name": "echo", "path": "echo", "echo_tick_ms": TICK_MS, "instances": 1, "parallel": 2}], **config)
    server = ServerProcess("--config", path, "--http", f"127.0.0.1:{port}", "--api-key-file", str(keys),
                           env={"MPSERVE_ADMIN_KEY": ADMIN_KEY})
    try:
        server.wait_ready()
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_up(url), 30, "the gateway answers /health")
        yield server, url
    finally:
        server.stop()
    assert not server.tracebacks(), "\n".join(server.log)


def _post(url: str, key: str, max_tokens: int) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": "x" * max_tokens, "max_tokens": max_tokens},
                      headers={"authorization": f"Bearer {key}"}, timeout=60)


def test_over_http_one_keys_requests_leave_every_other_key_served(tmp_path: Path) -> None:
    """Two API keys on one gateway: the first fills the pending share (max_pending_per_client) with long streams;
    its next request is 429 naming its tenant, with Retry-After, and the second key's request is served. /metrics
    shows the admin key every tenant's series, and the second key its own alone."""
    with _keyed_gateway(tmp_path, max_pending_per_client=3) as (server, url):
        with ThreadPoolExecutor(4) as pool, Client(server.admin) as admin:
            long = [pool.submit(_post, url, "first-key", HOLD_TOKENS) for _ in range(3)]
            wait_for(lambda: FIRST in (t := admin.stats().tenants) and t[FIRST].requests == 3, 10,
                     "the first key's 3 requests")
            over = _post(url, "first-key", 2)
            assert over.status_code == 429 and int(over.headers["retry-after"]) >= 1, over.text
            assert f"tenant {FIRST} has 3 requests pending" in over.json()["error"]["message"]
            served = _post(url, "second-key", 2)
            assert served.status_code == 200, served.text
            assert all(f.result().status_code == 200 for f in long)
        metrics = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=10).text
        assert f'mpserve_tenant_requests_total{{tenant="{FIRST}"}} 3.0' in metrics
        assert f'mpserve_tenant_generated_tokens_total{{tenant="{FIRST}"}} {3.0 * HOLD_TOKENS}' in metrics
        assert f'mpserve_tenant_running{{tenant="{FIRST}"}} 0.0' in metrics
        assert f'mpserve_tenant_requests_total{{tenant="{SECOND}"}} 1.0' in metrics
        own = httpx.get(url + "/metrics", headers={"authorization": "Bearer second-key"}, timeout=10).text
        assert f'mpserve_tenant_requests_total{{tenant="{SECOND}"}} 1.0' in own
        assert FIRST not in own, "a tenant's key sees another tenant's series"


@pytest.fixture(scope="module")
def limited_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, str]]:
    """A gateway whose first key's tenant may have 1 request running and 1 queued, the second's 60 tokens a
    minute; the third key's is unlimited."""
    with _keyed_gateway(tmp_path_factory.mktemp("limited"), tenants={
            FIRST: {"max_running": 1, "max_queued": 1}, SECOND: {"tokens_per_minute": 60}}) as started:
        yield started


def _refused_for_its_limit(answer: httpx.Response) -> str:
    """The error message of ``answer``, once checked to be a 429 ``busy`` with Retry-After (whole seconds, at least
    1)."""
    assert answer.status_code == 429, answer.text
    assert answer.json()["error"]["code"] == "busy", answer.text
    assert int(answer.headers["retry-after"]) >= 1, answer.headers
    message: str = answer.json()["error"]["message"]
    return message


@pytest.mark.timeout(60)
def test_over_http_a_tenant_over_max_queued_gets_429_naming_the_limit_and_its_use(
        limited_gateway: tuple[ServerProcess, str]) -> None:
    server, url = limited_gateway
    with ThreadPoolExecutor(2) as pool, Client(server.admin) as admin:
        hold = pool.submit(_post, url, "first-key", HOLD_TOKENS)
        wait_for(lambda: FIRST in (t := admin.stats().tenants) and t[FIRST].running == 1, 10, "the holding request")
        queued = pool.submit(_post, url, "first-key", 2)  # waits: its tenant runs its max_running
        wait_for(lambda: admin.stats().tenants[FIRST].queued == 1, 10, "the queued request")
        over = _post(url, "first-key", 2)
        assert f"tenant {FIRST} has 1 request queued, its max_queued (1), and 1 running, its max_running 1" in (
            _refused_for_its_limit(over))
        assert over.headers["retry-after"] == "1"  # a queued request ends soon
        served = _post(url, "third-key", 2)  # the other slot
        assert served.status_code == 200, served.text
        assert hold.result().status_code == 200 and queued.result().status_code == 200
        assert admin.stats().tenants[FIRST].refusals == 1


@pytest.mark.timeout(60)
def test_over_http_a_tenant_over_tokens_per_minute_gets_429_naming_the_limit_and_its_use(
        limited_gateway: tuple[ServerProcess, str]) -> None:
    server, url = limited_gateway
    with Client(server.admin) as admin:
        first = _post(url, "second-key", 80)  # admitted with none used; uses more than the 60
        assert first.status_code == 200, first.text
        figures = admin.stats().tenants[SECOND]
        used = figures.prompt_tokens + figures.generated_tokens
        assert used >= 80
        over = _post(url, "second-key", 2)
        assert (f"tenant {SECOND} has used {used} tokens (prompt and generated) in the last 60 s, its "
                "tokens_per_minute (60)") in _refused_for_its_limit(over)
        assert int(over.headers["retry-after"]) <= 60  # when the first request's tokens leave the window
        served = _post(url, "third-key", 2)
        assert served.status_code == 200, served.text
        assert admin.stats().tenants[SECOND].refusals == 1


def test_status_shows_each_tenants_figures(server: ServerProcess) -> None:
    asyncio.run(_order_behind_a_hold(server.admin, [(KEY_B, "b", 0)]))
    shown = mpserve("status", "--server-name", server.name)
    assert shown.returncode == 0, shown.stderr
    line = next(line for line in shown.stdout.splitlines() if line.startswith(f"tenant {KEY_B}:"))
    assert re.search(r": 0 running, 0 queued; \d+ requests?, \d+ prompt and [1-9]\d* generated tokens", line), line
    as_json = json.loads(mpserve("status", "--json", "--server-name", server.name).stdout)
    assert as_json["tenants"][KEY_B]["generated_tokens"] >= 2 and as_json["tenants"]["local"]["requests"] >= 1


def test_on_curve_each_client_key_is_a_tenant_of_its_own(tmp_path: Path) -> None:
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    allowed.mkdir()
    for name in ("server", "alice", "bob"):
        assert mpserve("keygen", str(keys), name).returncode == 0
    for name in ("alice", "bob"):
        (allowed / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
    alice = zmq.auth.load_certificate(str(keys / "alice.key"))[0].decode()
    address = f"tcp://127.0.0.1:{free_port()}"
    config = config_file(tmp_path, "curve", models=[
        {"name": "echo", "path": "echo", "echo_tick_ms": TICK_MS, "instances": 1, "parallel": 2}],
        tenants={alice: {"max_running": 1, "max_queued": 0}})
    server = ServerProcess("--config", config, "--bind", address, "--curve-secret", str(keys / "server.key_secret"),
                           "--curve-clients", str(allowed))

    def client(name: str) -> AsyncClient:
        return AsyncClient(address, curve_server_key=str(keys / "server.key"),
                           curve_secret=str(keys / f"{name}.key_secret"), timeout=60)

    async def run() -> None:
        async with client("alice") as a, client("bob") as b:
            hold = asyncio.ensure_future(a.generate("x" * HOLD_TOKENS, max_tokens=HOLD_TOKENS))
            await _until_running(a)
            with pytest.raises(Busy, match=rf"tenant {re.escape(alice)} has 0 requests queued, its max_queued \(0\), "
                                           r"and 1 running, its max_running 1"):
                await a.generate("over", max_tokens=2)
            with pytest.raises(Forbidden, match="'tenant' is named only over the server's admin socket"):
                await a.generate("as bob", max_tokens=2, tenant=KEY_B)
            assert (await b.generate("bob's", max_tokens=2)).usage.completion_tokens == 2  # the other slot
            await hold
            mine = (await a.stats()).tenants  # each key reads its own tenant's figures, never another's
            assert list(mine) == [alice] and mine[alice].requests == 1 and mine[alice].refusals == 1
            bob = zmq.auth.load_certificate(str(keys / "bob.key"))[0].decode()
            assert list((await b.stats()).tenants) == [bob]

    try:
        server.wait_ready()
        asyncio.run(run())
    finally:
        server.stop()
    assert not server.tracebacks(), "\n".join(server.log)


def test_a_gateway_that_cannot_reach_the_admin_socket_serves_keys_as_its_own(server: ServerProcess,
                                                                              tmp_path: Path) -> None:
    """A keyed gateway whose server's admin socket it cannot reach (a remote server without --admin-connect) still
    serves: its keys' requests go on the clients' socket, as one tenant."""
    from gateway_thread import GatewayThread  # uvicorn and openai: loaded only by the tests that use it

    gateway = GatewayThread(server_name=server.name, api_key="the-key", admin_connect=f"ipc://{tmp_path}/none")
    try:
        for _ in range(2):
            answer = httpx.post(gateway.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                headers={"authorization": "Bearer the-key"}, timeout=30)
            assert answer.status_code == 200, answer.text
    finally:
        gateway.stop()
