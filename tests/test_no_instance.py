"""A request for a model that no instance can serve ends within ``no_instance_timeout`` (1 s here), over ZeroMQ
and HTTP: ERROR ``no_instance`` / 503 saying why (no instance ever registered, the pool gone), and a stream whose
last instance was lost ends so after the text it had. Without the bound each of them waits for ever."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from conftest import ServerProcess
from gateway_thread import GatewayThread
from helpers import free_port, wait_for
from test_remote import FAST, Pool, registered

from mpserve import Client
from mpserve.errors import ErrorCode, NoInstance
from mpserve.runtime import ServerPaths

pytestmark = pytest.mark.timeout(120)

BOUND_S = 1.0
EXPIRY_S = 1.0  # FAST: a silent remote worker is lost after 4 heartbeats of 0.25 s
SLACK_S = 5.0  # the broker's watchdog period (0.5 s) and a busy machine's delays; without the bound: for ever


@pytest.fixture
def server(start_server: type[ServerProcess]) -> Iterator[tuple[ServerProcess, str]]:
    """A server that starts no instance and takes remote pools, and its workers' address."""
    address = f"tcp://127.0.0.1:{free_port()}"
    yield start_server("--instances", "0", "--workers-bind", address, "--no-instance-timeout", str(BOUND_S),
                       *FAST).wait_ready(), address


@pytest.fixture
def pool() -> Iterator[Callable[[str], Pool]]:
    started: list[Pool] = []

    def start(connect: str) -> Pool:
        started.append(Pool("pool-gone", connect, "--instances", "1", "--n-ctx", "2048"))
        return started[-1]

    yield start
    for p in started:
        if p.proc.poll() is None:
            p.stop()
        ServerPaths.for_name(p.name).slots.unlink(missing_ok=True)  # a SIGKILLed pool leaves its slot table


def post_chat(gw: GatewayThread) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = httpx.post(f"{gw.url}/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    return r, time.monotonic() - t0


def test_a_model_that_never_got_an_instance_is_refused_within_the_bound(server: tuple[ServerProcess, str]) -> None:
    srv, _ = server
    with Client(srv.address, timeout=60) as client:
        t0 = time.monotonic()
        with pytest.raises(NoInstance) as refused:
            client.generate("hello", max_tokens=4)
        took = time.monotonic() - t0
    assert BOUND_S <= took < BOUND_S + SLACK_S
    assert "has registered" in refused.value.message and "mpserve worker --connect" in refused.value.message
    gw = GatewayThread(server_name=srv.name)
    try:
        r, took = post_chat(gw)
    finally:
        gw.stop()
    assert r.status_code == 503 and r.json()["error"]["code"] == ErrorCode.NO_INSTANCE, r.text
    assert "has registered" in r.json()["error"]["message"] and int(r.headers["Retry-After"]) >= 1
    assert BOUND_S <= took < BOUND_S + SLACK_S


def test_a_stream_whose_pool_dies_ends_with_the_error_after_its_text(server: tuple[ServerProcess, str],
                                                                     pool: Callable[[str], Pool]) -> None:
    srv, address = server
    gone = pool(address)
    wait_for(lambda: sum(registered(srv.address).values()) == 1, 60, "the pool to register")
    pids = gone.pids()
    gw = GatewayThread(server_name=srv.name)
    try:
        stream = gw.openai().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=1500,
            temperature=0, stream=True, timeout=60)
        chunks = iter(stream)
        text = next(chunks).choices[0].delta.content or ""
        for pid in pids[1:]:
            os.kill(pid, signal.SIGSTOP)  # the stream is mid-way, however fast the model is
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(openai.APIError) as ended:
            for chunk in chunks:
                text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        took = time.monotonic() - killed
        assert ended.value.code == ErrorCode.NO_INSTANCE and "pool serving model tiny is gone" in ended.value.message
        assert text  # what it had came before the error
        assert took < EXPIRY_S + BOUND_S + SLACK_S

        r, took = post_chat(gw)  # a new request: the pool is still gone
        assert r.status_code == 503 and r.json()["error"]["code"] == ErrorCode.NO_INSTANCE, r.text
        assert "is gone" in r.json()["error"]["message"] and BOUND_S <= took < BOUND_S + SLACK_S
    finally:
        gw.stop()
    with Client(srv.address) as client:
        assert client.stats().counters[ErrorCode.NO_INSTANCE] == 2
