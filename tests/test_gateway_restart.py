"""A gateway in front of a server that restarts: the requests that arrive while no server answers wait for its next
start (up to the reattach bound) and are answered as they would have been, a chat from its model's own template; once
the server was stopped, not killed, they fail at once."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest
from gateway_thread import GatewayThread
from helpers import wait_for

ARGS = ("--instances", "1", "--chat-template", "llama3")
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8,
        "temperature": 0}
COMPLETION = {"model": "tiny", "prompt": "Hello world", "max_tokens": 8, "temperature": 0}
CALLS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION}


def _answer(path: str, body: dict[str, Any]) -> tuple[str, int]:
    """The text and prompt tokens of an answer (a chat's prompt tokens tell which template rendered it)."""
    choice = body["choices"][0]
    return (choice["message"]["content"] if path.endswith("chat/completions") else choice["text"],
            body["usage"]["prompt_tokens"])


@pytest.mark.timeout(120)
def test_requests_sent_while_the_server_is_down_wait_for_its_next_start_and_fail_at_once_after_a_stop(
        start_server) -> None:
    """A gateway that never reached its server yet (one started again beside a server killed meanwhile, as its
    supervisor does): its requests wait for the server's next start. A connected one's are held by its client's
    reattach (``tests/test_adoption.py``)."""
    server = start_server(*ARGS).wait_ready()
    first = GatewayThread(server_name=server.name)
    try:
        with httpx.Client(timeout=60) as http:
            alone = {path: _answer(path, http.post(first.url + path, json=body).json()) for path, body in CALLS.items()}
    finally:
        first.stop()
    server.proc.kill()  # what the OOM killer does; its supervisor starts it again
    server.proc.wait(10)
    gw = GatewayThread(server_name=server.name)
    try:
        answers: dict[str, httpx.Response] = {}
        threads = [threading.Thread(target=lambda p=path, b=body: answers.__setitem__(
            p, httpx.post(gw.url + p, json=b, timeout=60))) for path, body in CALLS.items()]
        for t in threads:
            t.start()
        wait_for(lambda: gw.metrics().get(("mpserve_http_requests_waiting_for_server", ())) == len(CALLS), 15,
                 "both requests waiting for a server")
        again = start_server(*ARGS, name=server.name).wait_ready()
        for t in threads:
            t.join(60)
        assert {p: r.status_code for p, r in answers.items()} == dict.fromkeys(CALLS, 200), \
            {p: r.text for p, r in answers.items()}
        assert {p: _answer(p, r.json()) for p, r in answers.items()} == alone  # the chat from llama3's template
        assert gw.metrics()[("mpserve_http_requests_waiting_for_server", ())] == 0
        again.stop()
        gone = httpx.post(gw.url + "/v1/completions", json=COMPLETION, timeout=10)  # well within the reattach bound
        assert gone.status_code == 503 and gone.json()["error"]["code"] == "connection", gone.text
    finally:
        gw.stop()
