"""Several gateway processes on one port (``--http-workers``, ``mpserve.gateway.fleet``): a gateway process that
dies takes only the connections it held, the others serve on, and it is started again; stored responses are
found through any of them, and the streams of one that died are taken up by another where they were; gateways that
keep dying as they start stop the server (exit status 1)."""

from __future__ import annotations

import http.client
import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ServerProcess
from helpers import free_port, wait_for

from mpserve import Client
from mpserve.runtime import pid_alive

PROMPT = "Once upon a time"
TOKENS = 1900  # long enough that a stream is still running when its gateway is killed


def _gateways(server: ServerProcess) -> list[int]:
    """The pids of the server's gateway processes."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        if b"gateway" in cmdline and b"--fd" in cmdline and int(stat.rsplit(")", 1)[1].split()[1]) == server.proc.pid:
            found.append(int(proc.name))
    return sorted(found)


def _holder(server: ServerProcess, port: int, client_port: int) -> int:
    """Which gateway process holds the accepted end of the client's connection from ``client_port`` (waited for:
    a new connection waits in the port's queue until a process accepts it). The server's gateway processes are
    looked up at each look: the one that accepts may be the replacement of one that died, started meanwhile."""
    found: int | None = wait_for(lambda: _accepted_by(_gateways(server), port, client_port), timeout=10,
                                 what=f"a gateway to accept the connection from port {client_port}")
    assert found is not None
    return found


def _accepted_by(gateways: list[int], port: int, client_port: int) -> int | None:
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = (int(end.split(":")[1], 16) for end in fields[1:3])
        if local == port and remote == client_port:
            inode = fields[9]
    if inode is None:
        return None
    for pid in gateways:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:  # it has just died
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == f"socket:[{inode}]":
                    return pid
            except OSError:
                continue
    return None


def _open_stream(conn: http.client.HTTPConnection) -> http.client.HTTPConnection:
    """A streamed completion on ``conn`` whose first event has been read."""
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": TOKENS,
                                                        "temperature": 0, "stream": True, "ignore_eos": True}),
                 {"content-type": "application/json"})
    conn.response = response = conn.getresponse()  # type: ignore[attr-defined]
    assert response.status == 200
    assert response.readline().startswith(b"data: ")
    return conn


def _connected(port: int) -> tuple[http.client.HTTPConnection, int]:
    """A new connection to the port, and the client's end's port."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.connect()
    return conn, conn.sock.getsockname()[1]


def _one_each(server: ServerProcess, gateways: list[int], port: int) -> dict[int, http.client.HTTPConnection]:
    """A connection accepted by each gateway process. The kernel gives a new connection to a process waiting in
    accept, so each process that took one is stopped until every one has one: the next can only go to another."""
    by_process: dict[int, http.client.HTTPConnection] = {}
    try:
        while len(by_process) < len(gateways):
            conn, client_port = _connected(port)
            holder = _holder(server, port, client_port)
            assert holder not in by_process, f"gateway process {holder}, stopped, accepted a connection"
            by_process[holder] = conn
            os.kill(holder, signal.SIGSTOP)
    finally:
        for pid in by_process:
            os.kill(pid, signal.SIGCONT)
    return by_process


def _rest(conn: http.client.HTTPConnection) -> bytes:
    data: bytes = conn.response.read()  # type: ignore[attr-defined]
    return data


@pytest.mark.timeout(240)
def test_a_dead_gateway_takes_only_its_connections_and_comes_back() -> None:
    port = free_port()
    server = ServerProcess("--model", "builtin:tiny", "--http", f"127.0.0.1:{port}", "--http-workers", "2",
                           "--parallel", "4", "--n-ctx", "2048").wait_ready()
    try:
        first = wait_for(lambda: _gateways(server) if len(_gateways(server)) == 2 else None, timeout=60,
                         what="two gateway processes")
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200, timeout=60,
                 what="the gateway to answer")
        streams = {pid: _open_stream(conn) for pid, conn in _one_each(server, first, port).items()}
        doomed, survivor = first
        os.kill(doomed, signal.SIGKILL)
        assert _rest(streams[survivor]).rstrip().endswith(b"data: [DONE]")  # the other gateway's stream ends whole
        with pytest.raises((http.client.IncompleteRead, ConnectionError)):  # the dead one's was cut
            _rest(streams[doomed])
        for _ in range(6):  # served meanwhile, by the survivor, and then by either
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                                json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4})
            assert answer.status_code == 200, answer.text
        replaced = wait_for(lambda: _gateways(server) if len(_gateways(server)) == 2 and doomed not in
                            _gateways(server) else None, timeout=60, what="the dead gateway to be replaced")
        assert survivor in replaced
        assert server.proc.poll() is None
        assert any(f"the HTTP gateway (pid {doomed}) was killed by signal 9; starting another" in line
                   for line in server.log)
    finally:
        server.stop()
    assert server.tracebacks() == []


@pytest.mark.timeout(120)
def test_a_stored_response_is_found_through_any_gateway_process() -> None:
    port = free_port()
    server = ServerProcess("--model", "echo", "--http", f"127.0.0.1:{port}", "--http-workers", "2").wait_ready()
    try:
        gateways = wait_for(lambda: _gateways(server) if len(_gateways(server)) == 2 else None, timeout=60,
                            what="two gateway processes")
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200, timeout=60,
                 what="the gateway to answer")
        by_process = _one_each(server, gateways, port)  # kept alive: each stays with its process

        def call(conn: http.client.HTTPConnection, method: str, path: str, body: object = None) -> tuple[int, Any]:
            conn.request(method, path, None if body is None else json.dumps(body),
                         {"content-type": "application/json"})
            answer = conn.getresponse()
            return answer.status, json.loads(answer.read())

        first, second = by_process.values()
        for storing, reading in ((first, second), (second, first)):
            status, stored = call(storing, "POST", "/v1/responses",
                                  {"model": "echo", "input": "remember this", "max_output_tokens": 4})
            assert status == 200, stored
            status, found = call(reading, "GET", f"/v1/responses/{stored['id']}")
            assert status == 200 and found["id"] == stored["id"], found
        for conn in by_process.values():
            conn.close()
    finally:
        server.stop()


@pytest.mark.timeout(120)
def test_gateways_that_keep_dying_as_they_start_stop_the_server() -> None:
    server = ServerProcess("--model", "echo", "--http", f"127.0.0.1:{free_port()}").wait_ready()
    killed: list[int] = []

    def kill_next() -> bool:
        for pid in _gateways(server):
            if pid not in killed:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        return server.proc.poll() is not None

    try:
        wait_for(kill_next, timeout=90, what="the server to give up on its gateway")
        assert server.proc.wait(30) == 1
    finally:
        server.stop()
    assert len(killed) == 5
    assert server.log[-1] == (f"error: [internal] the HTTP gateway (pid {killed[-1]}) was killed by signal 9, the "
                              "5th in a row within 10 s of its start, so the server stopped (its log above says "
                              "why); fix that and start again")
    assert server.tracebacks() == []
    assert not any(pid_alive(pid) for pid in killed)


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 1500,
        "temperature": 0, "stream": True, "ignore_eos": True}


def _sent_again(client: Client) -> dict[str, int] | None:
    """The broker's counters once a stream was sent again (taken up, or accepted anew after the first three)."""
    counters = client.stats().counters
    return counters if counters.get("rebound") or counters.get("accepted", 0) > 3 else None


def _datas(raw: bytes) -> list[str]:
    return [line[6:].decode() for line in raw.splitlines() if line.startswith(b"data: ")]


def _content(datas: list[str]) -> str:
    return "".join(json.loads(d)["choices"][0]["delta"].get("content") or "" for d in datas
                   if d != "[DONE]" and json.loads(d)["choices"])


@pytest.mark.timeout(240)
def test_streams_are_read_on_through_another_gateway_process_which_takes_them_over_if_their_own_died() -> None:
    port = free_port()
    server = ServerProcess("--model", "builtin:tiny", "--http", f"127.0.0.1:{port}", "--http-workers", "2",
                           "--reuse", "exact").wait_ready()
    try:
        wait_for(lambda: len(_gateways(server)) == 2, timeout=60, what="two gateway processes")
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200, timeout=60,
                 what="the gateway to answer")
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT, timeout=120) as whole:
            reference = _content(_datas(whole.read()))

        def started(request_id: str) -> tuple[int, bytes]:
            """The gateway process that produces the stream it starts, and the stream's first event, read up to its
            end."""
            conn, client_port = _connected(port)
            producer = _holder(server, port, client_port)
            conn.request("POST", "/v1/chat/completions", json.dumps(CHAT),
                         {"content-type": "application/json", "x-request-id": request_id})
            answer = conn.getresponse()
            assert answer.status == 200 and answer.readline() == b"id: 0\n"
            first = b"".join(iter(answer.readline, b"\n"))
            conn.close()
            return producer, first

        def elsewhere(producer: int, request_id: str) -> bytes:
            """The stream read on from after event 0 through a gateway process that does not produce it. The
            processes share one listening socket, and a new connection goes to whichever accepts first: on a busy
            host, the producer, awake, beats the other to it every time. So a live producer is stopped until
            another process has accepted the connection."""
            alive = pid_alive(producer)
            if alive:
                os.kill(producer, signal.SIGSTOP)
            try:
                conn, client_port = _connected(port)
                holder = _holder(server, port, client_port)
            finally:
                if alive:
                    os.kill(producer, signal.SIGCONT)
            assert holder != producer
            conn.request("POST", "/v1/chat/completions", json.dumps(CHAT),
                         {"content-type": "application/json", "x-request-id": request_id, "last-event-id": "0"})
            answer = conn.getresponse()
            assert answer.status == 200
            data: bytes = answer.read()
            return data

        producer, _ = started("live-1")
        rest = elsewhere(producer, "live-1")  # while the producer streams it
        assert rest.startswith(b"id: 1\n") and rest.rstrip().endswith(b"data: [DONE]")
        again = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT, timeout=120,
                           headers={"x-request-id": "live-1", "last-event-id": "0"})
        assert again.content == rest  # after its end, through either process
        assert _content(_datas(rest)) != "" and reference.endswith(_content(_datas(rest)))

        producer, first = started("doomed-1")
        instances = {row.pid for row in server.slots() if row.pid}
        with Client(server.address) as client, ThreadPoolExecutor(1) as pool:
            for pid in instances:  # the stream waits where it is until it is taken up: nothing ends it before
                os.kill(pid, signal.SIGSTOP)
            try:
                os.kill(producer, signal.SIGKILL)
                wait_for(lambda: not pid_alive(producer), timeout=10, what="the producing gateway process to die")
                reading = pool.submit(elsewhere, producer, "doomed-1")  # the other process takes the stream over
                try:
                    counters = wait_for(lambda: _sent_again(client), 30, "the stream sent again by the other process")
                except AssertionError as exc:  # what the server and its gateway processes said meanwhile
                    raise AssertionError("\n".join([str(exc), *server.log[-60:]])) from None
            finally:
                for pid in instances:
                    os.kill(pid, signal.SIGCONT)
            rest = reading.result()
        # taken up where it was: its text is not computed again
        assert counters.get("rebound") == 1, (counters, "\n".join(server.log[-40:]))
        assert rest.startswith(b"id: 1\n") and rest.rstrip().endswith(b"data: [DONE]"), rest[-300:]
        assert _content(_datas(first) + _datas(rest)) == reference  # nothing lost, nothing twice
        ids = [int(line[4:]) for line in rest.splitlines() if line.startswith(b"id: ")]
        assert ids == list(range(1, len(ids) + 1))

        # a background response whose gateway process dies: the other one takes it over when it is read
        body = {"model": "tiny", "input": "Tell me a story", "max_output_tokens": 1500, "temperature": 0}
        whole = httpx.post(f"http://127.0.0.1:{port}/v1/responses", json=body, timeout=120).json()
        conn, client_port = _connected(port)
        producer = _holder(server, port, client_port)
        conn.request("POST", "/v1/responses", json.dumps({**body, "background": True}),
                     {"content-type": "application/json"})
        head = json.loads(conn.getresponse().read())
        conn.close()
        with httpx.stream("GET", f"http://127.0.0.1:{port}/v1/responses/{head['id']}", params={"stream": "true"},
                          timeout=60) as some:
            next(line for line in some.iter_lines() if line.startswith("data: "))  # the producer has made some
        os.kill(producer, signal.SIGKILL)
        wait_for(lambda: _gateways(server) and producer not in _gateways(server), 30, "the gateway process gone")
        with httpx.stream("GET", f"http://127.0.0.1:{port}/v1/responses/{head['id']}", params={"stream": "true"},
                          timeout=120) as again:
            events = [json.loads(d) for d in _datas(again.read())]
        numbers = [e["sequence_number"] for e in events]
        assert numbers == list(range(len(events))), numbers
        assert events[-1]["type"] == f"response.{whole['status']}", events[-1]
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert text == whole["output"][0]["content"][0]["text"]
        stored = httpx.get(f"http://127.0.0.1:{port}/v1/responses/{head['id']}", timeout=30).json()
        assert stored["status"] == whole["status"] and stored["id"] == head["id"]
    finally:
        server.stop()
