"""What clients see when the server dies and is restarted (what systemd's ``Restart=on-failure`` does with
examples/systemd/mpserve.service) without adoption (``--adopt-wait 0``, a client with ``reattach=0``; the default,
where the streams go on, is ``test_adoption``'s): a request in flight fails with ``connection`` within the client's
liveness window, not at its timeout, over ZeroMQ and over HTTP (an ``error`` event of that code: the gateways of
``start --http`` with ``--reattach 0``); once a server of the same name is back, a retry succeeds, on the same
ZeroMQ client and on the same HTTP port.
And when it is stopped with a signal (``systemctl stop`` or ``restart``): a request in flight goes on for
``grace`` seconds, then ends ``shutting_down``; a second signal ends it at once."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from conftest import ServerProcess
from helpers import free_port, http_up, wait_for

from mpserve import Client
from mpserve.client import PING_INTERVAL_S, PING_LIVENESS
from mpserve.errors import ConnectionFailed, ShuttingDown
from mpserve.wire.slots import SlotState

REQUEST_TIMEOUT_S = 60.0
PROMPT = "Once upon a time"
LIVENESS_S = PING_INTERVAL_S * PING_LIVENESS
MAX_TOKENS = 8000  # long enough to be still running when the server is killed, on a slow or a fast machine


def _http_stream(url: str, outcome: list[object], streaming: threading.Event) -> None:
    """Stream a long completion; set ``streaming`` at its first event; record the error code of its last
    event, or the exception that ended it."""
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as response:
            for line in response.iter_lines():
                streaming.set()
                if line.startswith("data: {\"error\""):
                    outcome.append(json.loads(line[6:])["error"]["code"])
                    return
            outcome.append("ended")
    except httpx.HTTPError as exc:
        outcome.append(exc)


@pytest.mark.timeout(120)
def test_in_flight_requests_fail_promptly_and_a_retry_succeeds_once_the_server_is_back(start_server) -> None:
    port = free_port()
    args = ("--instances", "2", "--n-ctx", "8192", "--http", f"127.0.0.1:{port}", "--adopt-wait", "0",
            "--reattach", "0")
    server = start_server(*args).wait_ready()
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_up(url), 30, "the gateway answers")
    client = Client(server.address, timeout=REQUEST_TIMEOUT_S, reattach=0)
    try:
        stream = client.stream(PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        chunks = iter(stream)
        next(chunks)  # streaming
        http_outcome: list[object] = []
        http_streaming = threading.Event()
        http_thread = threading.Thread(target=_http_stream, args=(url, http_outcome, http_streaming))
        http_thread.start()
        assert http_streaming.wait(30), http_outcome
        wait_for(lambda: all(r.state is SlotState.BUSY for r in server.slots()), 10, "both requests running")

        server.proc.kill()  # a crash: what Restart=on-failure restarts
        killed = time.monotonic()
        server.proc.wait(10)  # reaped, as systemd does (a zombie's pid would still look alive)
        with pytest.raises(ConnectionFailed):
            for _ in chunks:
                pass
        zmq_failed_s = time.monotonic() - killed
        http_thread.join(REQUEST_TIMEOUT_S)
        http_failed_s = time.monotonic() - killed
        assert zmq_failed_s < LIVENESS_S + 3, zmq_failed_s
        assert http_failed_s < LIVENESS_S + 5, (http_failed_s, http_outcome)
        assert http_outcome == ["connection"], http_outcome

        again = start_server(*args, name=server.name)
        deadline = time.monotonic() + 60
        while True:  # what a client's retry loop does: connection is retryable
            try:
                result = client.generate(PROMPT, max_tokens=8, temperature=0, timeout=10)
                break
            except ConnectionFailed:
                assert time.monotonic() < deadline, "no retry succeeded within 60 s"
                time.sleep(0.5)
        assert result.usage.completion_tokens == 8
        wait_for(lambda: http_up(url), 30, "the restarted gateway answers on the same port")
        ok = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8}, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
        print(f"\nbroker SIGKILL: the ZeroMQ stream failed with connection after {zmq_failed_s:.1f} s, the HTTP "
              f"stream ({http_outcome[0]!r}) after {http_failed_s:.1f} s; request timeout {REQUEST_TIMEOUT_S:g} s")
        assert not again.tracebacks(), "\n".join(again.log)
    finally:
        client.close()


def _stopped_mid_stream(server: ServerProcess, signals: int) -> int:
    """Stream a long completion and send the server SIGTERM: a new request is refused ``shutting_down``, the
    stream goes on; at its first chunk after the signal, send ``signals - 1`` more. The stream must end
    ``shutting_down``, and the server exit 0. Returns the chunks that came after the first signal."""
    with Client(server.address, timeout=REQUEST_TIMEOUT_S) as client:
        chunks = iter(client.stream(PROMPT, max_tokens=MAX_TOKENS, temperature=0))
        next(chunks)
        server.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: any("shutting down: finishing 1 request" in line for line in server.log), 10,
                 "the server shutting down")
        with pytest.raises(ShuttingDown):
            client.generate(PROMPT, max_tokens=4, timeout=10)
        after = 0
        with pytest.raises(ShuttingDown, match="stopped before this request finished"):
            for _ in chunks:
                after += 1
                for _ in range(signals - 1 if after == 1 else 0):
                    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0, "\n".join(server.log)
    assert not server.tracebacks(), "\n".join(server.log)
    return after


@pytest.mark.timeout(60)
def test_a_request_in_flight_runs_through_the_grace_then_ends_shutting_down(start_server) -> None:
    server = start_server("--instances", "1", "--n-ctx", "8192", "--grace", "1").wait_ready()
    assert _stopped_mid_stream(server, signals=1) > 1
    assert any("grace period over; ending 1 request(s)" in line for line in server.log), "\n".join(server.log)


@pytest.mark.timeout(60)
def test_a_second_signal_skips_the_grace(start_server) -> None:
    """With a grace far longer than the whole request, the request ends ``shutting_down`` all the same: the
    second signal ended the grace (without it, the request would end DONE)."""
    server = start_server("--instances", "1", "--n-ctx", "8192", "--grace", "600").wait_ready()
    assert _stopped_mid_stream(server, signals=2) >= 1
    assert any("second signal: stopping now" in line for line in server.log), "\n".join(server.log)
