"""Every size and time limit answers at once with an error that names it, on both fronts: a real
``mpserve start --http`` (the gateway its child process), raw sockets and real clients, on loopback."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess
from helpers import dealer, free_port, http_up, raw_request, received, wait_for

from mpserve import Client
from mpserve.errors import BadRequest
from mpserve.gateway.api import openai as oai
from mpserve.gateway.http import guard
from mpserve.wire import protocol as wire

READ_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 64
PER_CLIENT = 32  # connections from one address: two addresses of 127.0.0.0/8 fill the gateway



class HttpServer:
    def __init__(self, server: ServerProcess, port: int) -> None:
        self.server, self.port, self.url = server, port, f"http://127.0.0.1:{port}"

    def post(self, path: str, body: bytes, **headers: str) -> httpx.Response:
        return httpx.post(self.url + path, content=body, headers={"content-type": "application/json", **headers},
                          timeout=10)

    def connect(self, source: str = "127.0.0.1") -> socket.socket:
        """A connection from ``source``, an address of 127.0.0.0/8 (each is another client address)."""
        return socket.create_connection(("127.0.0.1", self.port), timeout=10, source_address=(source, 0))


@pytest.fixture(scope="module")
def http() -> Iterator[HttpServer]:
    port = free_port()
    server = ServerProcess("--http", f"127.0.0.1:{port}", env={
        "MPSERVE_HTTP_READ_TIMEOUT": str(READ_TIMEOUT_S), "MPSERVE_HTTP_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
        "MPSERVE_HTTP_MAX_CONNECTIONS_PER_CLIENT": str(PER_CLIENT)})
    server.wait_ready()
    front = HttpServer(server, port)
    wait_for(lambda: http_up(front.url), 30, "the gateway answers /health")
    yield front
    server.stop()
    assert not server.tracebacks(), "\n".join(server.log)


def _openai_error(response: httpx.Response, status: int, code: str, words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    assert words in error["message"], error


def _served(front: HttpServer) -> None:
    assert front_ok(front.post("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}).encode()))


def front_ok(answer: httpx.Response) -> bool:
    return answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


@pytest.mark.timeout(60)
def test_prompts_over_the_limits_are_refused_at_once_over_zeromq(http) -> None:
    with Client(server_name=http.server.name, timeout=30) as client:
        assert client.max_message_bytes == wire.MAX_MESSAGE_BYTES  # told by the server's PONG
        with pytest.raises(BadRequest, match="MAX_PROMPT_CHARS"):
            client.generate("hello " * 200_000, max_tokens=2)
        with pytest.raises(BadRequest, match="MAX_MESSAGE_BYTES"):  # 4-byte characters: within the prompt limit
            client.generate("\N{GRINNING FACE}" * wire.MAX_PROMPT_CHARS, max_tokens=2)
        assert client.generate("hi", max_tokens=2).usage.completion_tokens == 2  # the connection is whole


@pytest.mark.timeout(60)
def test_a_raw_client_with_a_prompt_over_the_limit_gets_an_error_for_its_request(http) -> None:
    """Without the client's own check: the broker's error still names the request, so it reaches it."""
    with dealer(http.server.address) as sock:
        sock.send_multipart(raw_request({"id": "big", "prompt": "hello " * 200_000, "params": {"max_tokens": 2}}))
        error = received(sock, 10)
    assert isinstance(error, wire.Error) and error.id == "big" and error.code == "bad_request"
    assert str(wire.MAX_PROMPT_CHARS) in error.message


BODY_BYTES = 4 * 1024 * 1024  # the body limit as the docs state it, not read from the code that enforces it


@pytest.mark.timeout(60)
def test_http_bodies_over_a_limit_get_openai_errors_naming_it(http) -> None:
    assert "`MAX_BODY_BYTES` (4 MiB)" in (Path(__file__).parents[1] / "docs" / "http.md").read_text()
    url = "/v1/completions"
    for path in (url, "/tokenize", "/detokenize"):  # the vocabulary routes' once gave a plain-text 500
        _openai_error(http.post(path, b" " * (BODY_BYTES + 1)), 413, "request_too_large", "MAX_BODY_BYTES")
    _openai_error(http.post(url, b" " * BODY_BYTES), 400, "bad_request", "not valid JSON")  # at the limit: read

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(BODY_BYTES // 65536 + 2):
            yield b" " * 65536

    big = httpx.post(http.url + url, content=chunked(), headers={"Content-Type": "application/json"}, timeout=10)
    _openai_error(big, 413, "request_too_large", "MAX_BODY_BYTES")
    _openai_error(http.post(url, b"[" * 100_000), 400, "bad_request", "MAX_JSON_DEPTH")
    _openai_error(http.post(url, b"[" * 40 + b"]" * 40), 400, "bad_request", "MAX_JSON_DEPTH")
    _openai_error(http.post(url, b'{"prompt": "\xff\xfe"}'), 400, "bad_request", "not valid JSON")
    for body in (b'{"prompt": "\\ud800"}', b'{"prompt": "hi", "stop": ["\\udfff"]}', b'{"model": "\\udc00"}',
                 b'{"prompt": "hi", "json_schema": {"\\ud800": 1}}'):  # once a 500: UTF-8 cannot carry them
        _openai_error(http.post(url, body), 400, "bad_request", "lone surrogate")
    _openai_error(http.post("/tokenize", b'{"content": "\\ud800"}'), 400, "bad_request", "lone surrogate")
    for body in (b'{"prompt": [99999999999999999999]}', b'{"prompt": [2147483648]}'):  # int32 ids; once a 500
        _openai_error(http.post(url, body), 400, "bad_request", "integers from 0 to 2147483647")
    _openai_error(http.post("/detokenize", b'{"tokens": [2147483648]}'), 400, "bad_request", "from 0 to 2147483647")
    _openai_error(http.post(url, b'{"prompt": "hi", "logit_bias": {"99999999999999999999": 1}}'), 400, "bad_request",
                  "integers from 0 to 2147483647")
    huge = json.dumps({"prompt": "hello " * 200_000, "max_tokens": 2}).encode()
    _openai_error(http.post(url, huge), 400, "bad_request", "MAX_PROMPT_CHARS")
    many = json.dumps({"messages": [{"role": "user", "content": "hi"}] * 100_000, "max_tokens": 2}).encode()
    _openai_error(http.post("/v1/chat/completions", many), 400, "bad_request", "MAX_MESSAGES")
    stops = [str(i) for i in range(oai.MAX_STOP_STRINGS + 1)]
    _openai_error(http.post(url, json.dumps({"prompt": "hi", "stop": stops}).encode()), 400, "bad_request",
                  f"'stop' takes at most {oai.MAX_STOP_STRINGS} strings")
    # as many as allowed, on a chat without its model's template: its end of turn is one more (once a 400)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stop": stops[:-1]}
    assert http.post("/v1/chat/completions", json.dumps(chat).encode()).status_code == 200
    tools = json.dumps({"messages": [{"role": "user", "content": "hi"}],
                        "tools": [{"type": "function"}] * 10_000}).encode()
    _openai_error(http.post("/v1/chat/completions", tools), 400, "bad_request", "'tools'")
    _served(http)


def _answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while piece := sock.recv(65536):
        data += piece
    return data


def _status_and_error(answer: bytes) -> tuple[int, dict[str, str]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


@pytest.mark.timeout(60)
def test_half_headers_and_trickled_bodies_are_cut_off_after_the_read_timeout(http) -> None:
    started = time.monotonic()
    halves = [http.connect() for _ in range(20)]
    for sock in halves:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    trickle = http.connect()
    trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n{")
    _served(http)  # normal requests meanwhile
    while not select.select([trickle], [], [], 0.2)[0]:  # a byte now and then: the deadline is for the whole body
        trickle.sendall(b" ")
        assert time.monotonic() - started < READ_TIMEOUT_S + 5, "the trickled body was not cut off"
    status, error = _status_and_error(_answer(trickle))
    assert status == 408 and "body" in error["message"]
    trickle.close()
    for sock in halves:
        status, error = _status_and_error(_answer(sock))
        assert status == 408 and error["code"] == "request_timeout" and "headers" in error["message"]
        sock.close()
    assert time.monotonic() - started < READ_TIMEOUT_S + 5


def _refused(answer: bytes, words: str) -> None:
    status, error = _status_and_error(answer)
    assert status == 503 and error["code"] == "too_many_connections" and words in error["message"], error
    assert b"\r\nretry-after: 1\r\n" in answer.lower()


def _asked(sock: socket.socket, request: bytes) -> bytes:
    sock.sendall(request)
    return _answer(sock)


@pytest.mark.timeout(60)
def test_one_address_cannot_take_every_connection_and_health_is_answered_when_all_are_taken(http) -> None:
    """A client address holds at most its share; once every connection is taken (by two addresses here),
    GET /health is still answered, from the few held back for it, so a load balancer keeps the node, while
    anything else, and connections past the reserve, get 503 with Retry-After."""
    health = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    completion = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    held = [http.connect("127.0.0.2") for _ in range(PER_CLIENT)]
    reserved: list[socket.socket] = []
    try:
        with http.connect("127.0.0.2") as sock:  # one more from the same address: refused at once
            _refused(_answer(sock), f"127.0.0.2 has {PER_CLIENT} connections open")
        assert front_ok(http.post("/v1/completions", body))  # other addresses are served
        held += [http.connect("127.0.0.3") for _ in range(MAX_CONNECTIONS - PER_CLIENT)]
        with http.connect() as sock:  # every connection taken: /health still answered, then closed
            head, _, answer = _asked(sock, health).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"\r\nconnection: close" in head.lower(), head
        assert json.loads(answer)["status"] == "ok"
        with http.connect() as sock:
            _refused(_asked(sock, completion), f"{MAX_CONNECTIONS} connections open, its limit")
        reserved = [http.connect("127.0.0.4") for _ in range(guard.ConnectionLimits.health_reserve)]
        with http.connect("127.0.0.5") as sock:  # past the reserve too: refused before it sends anything
            _refused(_answer(sock), f"{MAX_CONNECTIONS} connections open, its limit")
        last = completion.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
        for sock in (held[PER_CLIENT - 1], held[-1]):  # the last connection each address was allowed: served
            assert _asked(sock, last).startswith(b"HTTP/1.1 200"), "a connection within the limits was refused"
    finally:
        for sock in held + reserved:
            sock.close()
    wait_for(lambda: http_up(http.url), 10, "served again once the connections are closed")
    _served(http)


@pytest.mark.timeout(60)
def test_what_is_not_http_gets_a_400_in_openai_shape(http) -> None:
    with http.connect() as sock:
        sock.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
        status, error = _status_and_error(_answer(sock))
    assert status == 400 and error["code"] == "invalid_http"
    with http.connect() as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n")
        status, error = _status_and_error(_answer(sock))
    assert status == 400 and "headers over" in error["message"]
    with http.connect() as sock:  # one header never finished, however it is read: the parser holds it unseen
        sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        for _ in range(3):
            sock.sendall(b"a" * 7_000)
        status, error = _status_and_error(_answer(sock))
    assert status == 400 and "headers over" in error["message"]
    filler = {f"X-Filler-{i}": "v" * 1_000 for i in range(12)}  # a head of 12 kB, under the 16 kB limit
    assert front_ok(http.post("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}).encode(), **filler))
    with http.connect() as sock:  # a body cut by a broken chunk: once a traceback on the vocabulary routes
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n4\r\n{\"co\r\nzz\r\n")
        status, error = _status_and_error(_answer(sock))
    assert status == 400 and error["code"] == "invalid_http"


@pytest.mark.timeout(60)
def test_an_upgrade_to_websocket_is_answered_as_plain_http(http) -> None:
    """The gateway has no WebSocket route; uvicorn would hand such a connection to a WebSocket protocol
    (outside the guard's limits) that closed it without a word. A request asking for an upgrade is answered as
    plain HTTP and its connection closed after it (llhttp parses nothing after such a head); one with a body
    is refused in OpenAI's shape, naming the header, as llhttp leaves that body unparsed."""
    with http.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
        head, _, answer = _answer(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"\r\nconnection: close" in head.lower()
    assert json.loads(answer)["status"] == "ok"
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    with http.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                     b"Connection: Upgrade\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        status, error = _status_and_error(_answer(sock))
    assert status == 400 and error["code"] == "invalid_http" and "Upgrade" in error["message"]
    _served(http)
