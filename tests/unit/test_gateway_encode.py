"""The gateway's wire encoding: events as Python's JSON would write them, the events of a step in one send,
a stream closed when its client hangs up, and one socket write per turn of the event loop."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, MutableMapping
from typing import Any

import pytest

from mpserve.gateway.http import encode
from mpserve.gateway.http.guard import _Coalesced

pytestmark = pytest.mark.timeout(30)

CHUNK = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
         "choices": [{"index": 0, "text": "Grüße, 世界 \"quoted\"\n", "logprobs": None, "finish_reason": None}]}


def test_events_are_what_python_json_writes_and_join_in_one_piece() -> None:
    old = b"data: " + json.dumps(CHUNK, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
    assert encode.event(CHUNK) == old
    assert encode.events([CHUNK, CHUNK]) == old * 2
    assert encode.events([]) == b""


def test_a_number_that_is_not_finite_is_null_valid_json() -> None:
    assert json.loads(encode.event({"logprob": float("-inf")})[6:]) == {"logprob": None}


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> Any:
        return name


def test_writes_within_one_turn_leave_in_one_write_and_close_flushes_first() -> None:
    async def run() -> _Transport:
        real = _Transport()
        coalesced = _Coalesced(real, asyncio.get_running_loop())  # type: ignore[arg-type]
        coalesced.write(b"head")
        coalesced.write(b"body")
        assert real.writes == []
        await asyncio.sleep(0)  # not a wait: a turn of the event loop
        assert real.writes == [b"headbody"]
        coalesced.write(b"end")
        coalesced.close()
        assert real.writes == [b"headbody", b"end"] and real.closed
        assert coalesced.get_extra_info("peername") == "peername"  # the rest is the transport's
        return real

    asyncio.run(run())


def test_a_stream_sends_its_frames_and_closes_its_generator_when_the_client_hangs_up() -> None:
    closed = asyncio.Event()

    async def frames() -> AsyncGenerator[bytes, None]:
        try:
            yield b"data: 1\n\n"
            yield b""  # nothing to send: skipped
            await asyncio.Event().wait()  # the next chunk never comes
            yield b"never"
        finally:
            closed.set()

    async def run() -> list[MutableMapping[str, Any]]:
        sent: list[MutableMapping[str, Any]] = []
        hung_up = asyncio.Event()

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)
            if message.get("body"):
                hung_up.set()

        async def receive() -> dict[str, Any]:
            await hung_up.wait()
            return {"type": "http.disconnect"}

        await asyncio.wait_for(encode.EventStream(frames())({"type": "http"}, receive, send), 10)
        assert closed.is_set()
        return sent

    sent = asyncio.run(run())
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[1]["body"] == b"data: 1\n\n"
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
