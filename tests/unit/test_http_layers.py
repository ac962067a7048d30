"""``bench.http_overhead``'s split of the gateway's py-spy samples by layer: a sample goes to the layer of its
innermost frame that is in one."""

from __future__ import annotations

import pytest

from bench.http_overhead import layer_shares

pytestmark = pytest.mark.timeout(10)

LOOP = "run_forever (asyncio/base_events.py:608);_run_once (asyncio/base_events.py:1922)"
ASGI = "run_asgi (uvicorn/protocols/http/httptools_impl.py:420);__call__ (starlette/routing.py:704)"


def test_each_sample_goes_to_its_innermost_frame_that_has_a_layer() -> None:
    raw = [
        f"{LOOP};EpollSelector.select (selectors.py:468) 40",  # the poll's system call: the loop's
        f"{LOOP};{ASGI};serve (/srv/mpserve/gateway/api/dialect.py:165);__init__ (<string>:3) 30",  # a dataclass's
        f"{LOOP};_on_events (/srv/mpserve/client.py:473);decode (/srv/mpserve/wire/protocol.py:1312) 20",
        f"{LOOP};data_received (/srv/mpserve/gateway/http/guard.py:95) 10",
        "",
    ]
    assert list(layer_shares(raw).items()) == [
        ("event loop and socket I/O (asyncio)", 0.4),
        ("OpenAI shapes and the gateway's own logic", 0.3),
        ("link to the broker (AsyncClient, wire, pyzmq)", 0.2),
        ("HTTP server (uvicorn, httptools, the guard)", 0.1),
    ]


def test_a_frame_outside_every_layer_is_other_and_no_samples_share_nothing() -> None:
    assert layer_shares(["main (/srv/tool.py:3);helper (/srv/tool.py:9) 4"]) == {"other": 1.0}
    assert layer_shares([]) == {}
