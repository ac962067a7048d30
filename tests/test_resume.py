"""Streams that outlive their connection (``mpserve.gateway.api.journal``): a chat stream named by the caller's
``X-Request-Id`` read on with ``Last-Event-ID``, and a background response read on with ``starting_after``, give
the text of an uninterrupted run, no event twice; through another gateway process too; and each misuse is refused
naming the fix."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gateway_thread import GatewayThread
from helpers import wait_for

from mpserve import Client
from mpserve.gateway.api.response_store import path_for

pytestmark = pytest.mark.timeout(120)

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 600,
        "temperature": 0, "stream": True, "ignore_eos": True}


@pytest.fixture
def exact(start_server) -> Iterator[GatewayThread]:
    server = start_server("--reuse", "exact", "--parallel", "2").wait_ready()
    gateway = GatewayThread(server_name=server.name)
    yield gateway
    gateway.stop()


def _events(lines: Iterator[str]) -> Iterator[tuple[int | None, str]]:
    """(id, data) of each server-sent event."""
    event_id: int | None = None
    for line in lines:
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            yield event_id, line[6:]
            event_id = None


def _text(datas: list[str]) -> str:
    return "".join(json.loads(d)["choices"][0]["delta"].get("content") or "" for d in datas
                   if d != "[DONE]" and json.loads(d)["choices"])


def _uninterrupted(gateway: GatewayThread) -> str:
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=BODY, timeout=60) as whole:
        return _text([data for _, data in _events(whole.iter_lines())])


def test_a_chat_stream_read_on_after_its_connection_broke_gives_the_uninterrupted_text(exact: GatewayThread) -> None:
    reference = _uninterrupted(exact)
    url, headers = f"{exact.url}/v1/chat/completions", {"X-Request-Id": "story-1"}
    seen: list[tuple[int | None, str]] = []
    with httpx.stream("POST", url, json=BODY, headers=headers, timeout=60) as first:
        for event in _events(first.iter_lines()):
            seen.append(event)
            if len(seen) == 2:
                break  # the connection is closed here, mid-stream
    assert [i for i, _ in seen] == [0, 1]
    with httpx.stream("POST", url, json=BODY, headers={**headers, "Last-Event-ID": "1"}, timeout=60) as again:
        assert again.status_code == 200
        rest = list(_events(again.iter_lines()))
    assert len(rest) > 2  # text, then [DONE], came after the break
    ids = [i for i, _ in seen + rest]
    assert ids == list(range(len(ids))), "an event was lost or sent twice"
    datas = [d for _, d in seen + rest]
    assert datas[-1] == "[DONE]"
    assert _text(datas) == reference and len(reference) > 0


def test_misuses_of_a_resume_are_refused_naming_the_fix(exact: GatewayThread) -> None:
    url = f"{exact.url}/v1/chat/completions"
    no_id = httpx.post(url, json=BODY, headers={"Last-Event-ID": "3"}, timeout=30)
    assert no_id.status_code == 400 and "send the same X-Request-Id" in no_id.text
    unknown = httpx.post(url, json=BODY, headers={"X-Request-Id": "never", "Last-Event-ID": "3"}, timeout=30)
    assert unknown.status_code == 404 and "send the request again without Last-Event-ID" in unknown.text
    with httpx.stream("POST", url, json=BODY, headers={"X-Request-Id": "story-2"}, timeout=60) as first:
        next(_events(first.iter_lines()))
    other = httpx.post(url, json={**BODY, "max_tokens": 5}, headers={"X-Request-Id": "story-2", "Last-Event-ID": "0"},
                       timeout=30)
    assert other.status_code == 400 and "was another request" in other.text
    bad = httpx.post(url, json=BODY, headers={"X-Request-Id": "story-2", "Last-Event-ID": "x"}, timeout=30)
    assert bad.status_code == 400 and "Last-Event-ID must be" in bad.text
    someone_else = httpx.post(url, json=BODY, headers={"X-Request-Id": "story-2", "Last-Event-ID": "0",
                                                       "Authorization": "Bearer another"}, timeout=30)
    assert someone_else.status_code == 404  # another caller's stream is not found


def _output_text(datas: list[str]) -> str:
    return "".join(json.loads(d)["delta"] for d in datas if json.loads(d)["type"] == "response.output_text.delta")


def test_a_background_response_runs_on_and_its_events_are_read_on_with_starting_after(exact: GatewayThread) -> None:
    body = {"model": "tiny", "input": "Tell me a story", "max_output_tokens": 600, "temperature": 0}
    whole = httpx.post(f"{exact.url}/v1/responses", json=body, timeout=60).json()
    reference = whole["output"][0]["content"][0]["text"]
    started = httpx.post(f"{exact.url}/v1/responses", json={**body, "background": True}, timeout=60)
    assert started.status_code == 200, started.text
    head = started.json()
    assert head["status"] == "queued" and head["background"] is True
    url = f"{exact.url}/v1/responses/{head['id']}"
    seen: list[str] = []
    with httpx.stream("GET", url, params={"stream": "true"}, timeout=60) as first:
        for _, data in _events(first.iter_lines()):
            seen.append(data)
            if len(seen) == 5:  # created, in_progress, output_item.added, content_part.added, the first delta
                break
    numbers = [json.loads(d)["sequence_number"] for d in seen]
    assert numbers == list(range(5))
    with httpx.stream("GET", url, params={"stream": "true", "starting_after": "4"}, timeout=60) as again:
        rest = [data for _, data in _events(again.iter_lines())]
    assert any(json.loads(d)["type"] == "response.output_text.delta" for d in rest)
    everything = seen + rest
    assert [json.loads(d)["sequence_number"] for d in everything] == list(range(len(everything)))
    assert json.loads(everything[-1])["type"] == f"response.{whole['status']}"
    assert _output_text(everything) == reference
    done = httpx.get(url, timeout=30).json()
    assert done["status"] == whole["status"] and done["output"][0]["content"][0]["text"] == reference


def test_a_background_response_can_be_cancelled_and_needs_store(exact: GatewayThread) -> None:
    body = {"model": "tiny", "input": "Tell me a story", "max_output_tokens": 4000, "temperature": 0,
            "background": True}
    refused = httpx.post(f"{exact.url}/v1/responses", json={**body, "store": False}, timeout=30)
    assert refused.status_code == 400 and "'background' needs 'store'" in refused.text
    head = httpx.post(f"{exact.url}/v1/responses", json=body, timeout=30).json()
    url = f"{exact.url}/v1/responses/{head['id']}"
    assert httpx.get(url, timeout=30).json()["status"] in ("queued", "in_progress")
    cancelled = httpx.post(f"{url}/cancel", timeout=30)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    with httpx.stream("GET", url, params={"stream": "true"}, timeout=60) as events:
        datas = [data for _, data in _events(events.iter_lines())]  # it ends: the stream stopped
    assert all(json.loads(d)["type"] != "response.completed" for d in datas)
    assert httpx.get(url, timeout=30).json()["status"] == "cancelled"
    assert httpx.post(f"{url}/cancel", timeout=30).status_code == 404


def _journaled(path: Path, key: str) -> int:
    """The rows the journal holds of stream ``key``: its own, its events, its request, the text of its batches."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        return sum(db.execute(f"SELECT count(*) FROM {table} WHERE key = ?", (key,)).fetchone()[0]  # noqa: S608
                   for table in ("streams", "events", "asked", "fed"))


def test_deleting_a_background_response_deletes_it_and_stops_it_while_it_runs(start_server) -> None:
    """A DELETE of a background response, ended or running: it is no longer read (whole, or its events again), its
    journal keeps nothing of it (its prompt included), and one that ran is stopped and never stored after."""
    server = start_server("--parallel", "2").wait_ready()
    gateway = GatewayThread(server_name=server.name)
    file = path_for(server.name, int(gateway.url.rsplit(":", 1)[1]))
    body = {"model": "tiny", "input": "Tell me a story", "temperature": 0, "background": True}
    instances: set[int] = set()
    try:
        ended = httpx.post(f"{gateway.url}/v1/responses", json={**body, "max_output_tokens": 8}, timeout=30).json()
        running = httpx.post(f"{gateway.url}/v1/responses", json={**body, "max_output_tokens": 4000},
                             timeout=30).json()
        urls = [f"{gateway.url}/v1/responses/{r['id']}" for r in (ended, running)]
        wait_for(lambda: httpx.get(urls[0], timeout=10).json()["status"] == "incomplete", 30, "the first one's end")
        wait_for(lambda: httpx.get(urls[1], timeout=10).json()["status"] == "in_progress", 30, "the second running")
        instances = {r.pid for r in server.slots() if r.pid > 0}
        for pid in instances:  # it cannot end before its DELETE, however fast the model is
            os.kill(pid, signal.SIGSTOP)
        assert all(_journaled(file, r["id"]) > 0 for r in (ended, running))
        for url, response in zip(urls, (ended, running), strict=True):
            deleted = httpx.delete(url, timeout=30)
            assert deleted.status_code == 200 and deleted.json() == {"id": response["id"], "object": "response",
                                                                     "deleted": True}
            assert httpx.get(url, timeout=30).status_code == 404
            assert httpx.get(url, params={"stream": "true"}, timeout=30).status_code == 404
            assert _journaled(file, response["id"]) == 0
            assert httpx.delete(url, timeout=30).status_code == 404
        with Client(server.address) as client:
            wait_for(lambda: client.stats().counters.get("cancelled") == 1, 30, "the running one cancelled")
            for pid in instances:
                os.kill(pid, signal.SIGCONT)
            wait_for(lambda: client.stats().models["tiny"].running == 0, 30, "its instance to stop it")
        assert httpx.get(urls[1], timeout=30).status_code == 404 and _journaled(file, running["id"]) == 0
    finally:
        for pid in instances:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        gateway.stop()


def test_a_stream_nobody_read_on_ends_its_resume_saying_it_was_stopped(exact: GatewayThread,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from mpserve.gateway.api import journal

    monkeypatch.setattr(journal, "GRACE_S", 0.0)  # stopped at its next batch once its client has left
    url, headers = f"{exact.url}/v1/chat/completions", {"X-Request-Id": "left-1"}
    body = {**BODY, "max_tokens": 1500}
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as first:
        next(_events(first.iter_lines()))
    with httpx.stream("POST", url, json=body, headers={**headers, "Last-Event-ID": "0"}, timeout=60) as again:
        datas = [data for _, data in _events(again.iter_lines())]
    assert datas[-1] != "[DONE]" and json.loads(datas[-1])["error"]["code"] == "cancelled"  # not a silent end
    cancel = httpx.post(f"{exact.url}/v1/responses/left-1/cancel", timeout=30)  # a chat stream: no response
    assert cancel.status_code == 404
