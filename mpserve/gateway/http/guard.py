"""The gateway's connections: uvicorn's httptools protocol with the limits a network front needs.

    TCP (or TLS) connection ──▶ GuardedHttpToolsProtocol ──▶ the Starlette app
        over max_connections_per_client from its address: 503 with Retry-After, closed at once
        over max_connections open:                 only GET /health is answered (one of HEALTH_RESERVE
                                                   connections kept for it, closed after its answer); any
                                                   other request, or past the reserve, 503 with Retry-After
        request headers not complete within read_timeout of waiting for them (slowloris): 408, closed
        idle between requests for keep_alive:      closed (uvicorn's own timeout)
        not HTTP, or a request line and headers over max_header_bytes: 400, closed
        Upgrade (websocket or any):                answered as plain HTTP, then closed (no WebSocket protocol:
                                                   the gateway has no such route, and one would escape these
                                                   limits); with a body, 400: llhttp leaves it unparsed
    the answer ──▶ _Coalesced: what one turn of the event loop writes ──▶ one write to the socket

httptools (llhttp, in C) parses where h11 parsed in Python: the gateway's own cost per request is what a
2-core host takes from llama.cpp's threads (``python -m bench.http_overhead`` shows it per process). llhttp
sets no bound on a request's head, so it is counted here: the line and headers as they are parsed, and what
arrives while a head is still incomplete (a header trickled in pieces is buffered by the parser unseen).

uvicorn writes a response's head, each body piece and its end apart, a system call each (and a wake-up of
the client each); written within one turn of the loop they leave together: a whole answer in one write, a
stream's head with its first event, its last event with its end.

uvicorn times only the idle wait between requests, so a client that sends half a header holds its
connection forever; here a deadline starts whenever the connection waits for a request and ends when its
headers are complete. uvicorn's own ``limit_concurrency`` answers in plain text, and only once a request
arrives; this bound counts connections as they open. One client address cannot take them all: a cap per
address leaves the rest to others, and a load balancer's probe of ``/health`` is answered from connections
held back for it even when every other one is taken, so the node is not dropped while a client floods it.
Every answer is OpenAI's error object. A body that
trickles is ``limits``' (408 from the app).
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .errors import HttpError

log = logging.getLogger("mpserve.gateway")


HEALTH_PATH = b"/health"


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 1024
    max_connections_per_client: int = 256  # from one client address (behind a proxy: all of them)
    read_timeout: float = 30.0  # seconds for a request's headers (and, in the app, for its body)
    keep_alive: float = 5.0  # seconds a connection may stay idle between requests
    max_header_bytes: int = 16 * 1024  # a request line and headers
    retry_after: float = 1.0  # what a refused connection is told
    health_reserve: int = 8  # connections past max_connections that may ask for /health alone


def uvicorn_options(limits: ConnectionLimits) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.run`` / ``uvicorn.Config``: the protocol bound to these limits."""
    bound = type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"limits": limits, "peers": Counter()})
    return {"http": bound, "ws": "none", "timeout_keep_alive": limits.keep_alive}


def raw_response(err: HttpError) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for answers outside any request cycle."""
    body = json.dumps(err.body()).encode()
    headers = {"content-type": "application/json", "content-length": str(len(body)), "connection": "close",
               **{k.lower(): v for k, v in err.headers().items()}}
    head = f"HTTP/1.1 {err.status} {http.HTTPStatus(err.status).phrase}\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in headers.items())
    return head.encode() + b"\r\n" + body


class _Refused(Exception):
    """Raised from a parser callback, the refusal set: llhttp stops, and uvicorn answers ``send_400_response``."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    limits = ConnectionLimits()
    peers: Counter[str] = Counter()  # open connections by client address (``uvicorn_options`` gives one per server)

    _deadline: asyncio.TimerHandle | None = None
    _awaiting_head = True  # from the connection or a request's end until the next request's headers are complete
    _head_arrived = 0  # bytes that arrived while awaiting the head
    _head_parsed = 0  # the head's line and headers, as the parser has passed them
    _refused = False  # over a limit: nothing it sends is read
    _peer: str | None = None  # the client address it is counted under
    _health_only = False  # over max_connections, within the reserve: GET /health alone is answered
    _refusal: HttpError | None = None  # why a request is refused, where it is known

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(cast(asyncio.Transport, _Coalesced(transport, self.loop)))
        self._peer = self.client[0] if self.client else "local"
        self.peers[self._peer] += 1
        if self.peers[self._peer] > self.limits.max_connections_per_client:
            self._refuse(f"{self._peer} has {self.limits.max_connections_per_client} connections open to the "
                         "gateway, its limit per client address; close some, or retry later")
        elif len(self.connections) > self.limits.max_connections + self.limits.health_reserve:
            self._refuse(self._full())
        else:
            self._health_only = len(self.connections) > self.limits.max_connections
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._peer is not None:
            self.peers[self._peer] -= 1
            if not self.peers[self._peer]:
                del self.peers[self._peer]
            self._peer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._awaiting_head:
            self._head_arrived += len(data)
        super().data_received(data)
        if self._awaiting_head and self._head_arrived > self.limits.max_header_bytes:  # still incomplete
            self._refusal = self._head_too_large()
            self.send_400_response("Invalid HTTP request received.")

    # parser callbacks: the head's size as it is parsed (a head that came whole in one read is caught here)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_parsed = 0

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._awaiting_head = False
        self._disarm()
        upgrade = self.parser.should_upgrade()  # httptools then reads no body: what follows is the new protocol's
        if upgrade and _declares_body(self.headers):
            self._refusal = HttpError(400, "invalid_http", "a request that asks for an Upgrade cannot carry a "
                                          "body here (the gateway has no WebSocket route): send it without the "
                                          "Upgrade header")
            raise _Refused
        if self._health_only and (self.parser.get_method() != b"GET" or self.url.partition(b"?")[0] != HEALTH_PATH):
            self._refusal = HttpError(503, "too_many_connections", self._full() + " (connections past it "
                                          "answer GET /health alone)", self.limits.retry_after)
            raise _Refused
        super().on_headers_complete()
        if upgrade or self._health_only:  # after an Upgrade llhttp parses nothing; a reserved one is freed
            self.cycle.keep_alive = False

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._awaiting_head, self._head_arrived = True, 0  # what follows is the next request's head

    def on_response_complete(self) -> None:
        if not self.pipeline:  # else the next request, its headers complete, starts now
            self._arm()
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        self._close_with(self._refusal or HttpError(400, "invalid_http", f"{msg} (not HTTP/1.1)"))

    def _unsupported_upgrade_warning(self) -> None:
        log.debug("an Upgrade request answered as plain HTTP (the gateway has no WebSocket route)")

    def _count(self, size: int) -> None:
        self._head_parsed += size
        if self._head_parsed > self.limits.max_header_bytes:
            self._refusal = self._head_too_large()
            raise _Refused

    def _full(self) -> str:
        return f"the gateway has {self.limits.max_connections} connections open, its limit; retry later"

    def _refuse(self, why: str) -> None:
        self._refused = True
        self._close_with(HttpError(503, "too_many_connections", why, self.limits.retry_after))

    def _head_too_large(self) -> HttpError:
        return HttpError(400, "invalid_http", f"request line and headers over "
                             f"{self.limits.max_header_bytes} bytes (the gateway's limit)")

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.limits.read_timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self._awaiting_head:  # part of a request's head came, or none at all
            self._close_with(HttpError(408, "request_timeout", f"the request headers did not arrive within "
                                           f"{self.limits.read_timeout:g} s (the gateway's read timeout)"))
        elif not self.transport.is_closing():
            self.transport.close()  # what is left of a request whose answer has gone out

    def _close_with(self, err: HttpError) -> None:
        if not self.transport.is_closing():
            self.transport.write(raw_response(err))
            self.transport.close()


def _declares_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request's headers (names in lower case) announce a body."""
    return any(name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0")
               for name, value in headers)


class _Coalesced:
    """``transport``, whose writes within one turn of the event loop go out in one write, at its end (and
    before a close)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._parts:
            self._loop.call_soon(self._flush)
        self._parts.append(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def _flush(self) -> None:
        if self._parts:
            data = b"".join(self._parts)
            self._parts.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
