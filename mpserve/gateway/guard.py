"""The gateway's connections: uvicorn's h11 protocol with the limits a network front needs.

    TCP (or TLS) connection ──▶ GuardedH11Protocol ──▶ the Starlette app
        over max_connections open:                 503 with Retry-After, closed at once
        request headers not complete within read_timeout of waiting for them (slowloris): 408, closed
        idle between requests for keep_alive:      closed (uvicorn's own timeout)
        not HTTP, or headers over h11's size limit: 400, closed
        Upgrade: websocket:                        answered as plain HTTP (no WebSocket protocol: the
                                                   gateway has no such route, and one would escape these limits)
    the answer ──▶ _Coalesced: what one turn of the event loop writes ──▶ one write to the socket

uvicorn writes a response's head, each body piece and its end apart, a system call each (and a wake-up of
the client each); written within one turn of the loop they leave together: a whole answer in one write, a
stream's head with its first event, its last event with its end.

uvicorn times only the idle wait between requests, so a client that sends half a header holds its
connection forever; here a deadline starts whenever the connection waits for a request and ends when its
headers are complete. uvicorn's own ``limit_concurrency`` answers in plain text, and only once a request
arrives; this bound counts connections as they open. Every answer is OpenAI's error object. A body that
trickles is ``limits``' (408 from the app).
"""

from __future__ import annotations

import asyncio
import http
import json
from dataclasses import dataclass
from typing import Any, cast

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from . import openai as oai


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 1024
    read_timeout: float = 30.0  # seconds for a request's headers (and, in the app, for its body)
    keep_alive: float = 5.0  # seconds a connection may stay idle between requests
    max_header_bytes: int = 16 * 1024  # a request line and headers (h11's incomplete-event limit)
    retry_after: float = 1.0  # what a refused connection is told


def uvicorn_options(limits: ConnectionLimits) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.run`` / ``uvicorn.Config``: the protocol bound to these limits."""
    bound = type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
    return {"http": bound, "ws": "none", "timeout_keep_alive": limits.keep_alive, "h11_max_incomplete_event_size":
            limits.max_header_bytes}


def raw_response(err: oai.HttpError) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for answers outside any request cycle."""
    body = json.dumps(err.body()).encode()
    headers = {"content-type": "application/json", "content-length": str(len(body)), "connection": "close",
               **{k.lower(): v for k, v in err.headers().items()}}
    head = f"HTTP/1.1 {err.status} {http.HTTPStatus(err.status).phrase}\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in headers.items())
    return head.encode() + b"\r\n" + body


class GuardedH11Protocol(H11Protocol):
    limits = ConnectionLimits()

    _deadline: asyncio.TimerHandle | None = None
    _waiting_since: object = None  # the request cycle that was current when the deadline was armed
    _refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(cast(asyncio.Transport, _Coalesced(transport, self.loop)))
        if len(self.connections) > self.limits.max_connections:
            self._refused = True
            self._close_with(oai.HttpError(503, "too_many_connections", f"the gateway has "
                                           f"{self.limits.max_connections} connections open, its limit; retry "
                                           "later", self.limits.retry_after))
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self.conn.their_state is h11.IDLE and self._head_too_large(data):
            self.send_400_response("Invalid HTTP request received.")
            return
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not self._waiting_since:  # a request's headers are complete
            self._disarm()

    def on_response_complete(self) -> None:
        self._arm()  # before uvicorn starts a pipelined request, which then disarms it
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        self._close_with(oai.HttpError(400, "invalid_http", f"{msg} (not HTTP/1.1, or headers over "
                                       f"{self.limits.max_header_bytes} bytes)"))

    def _head_too_large(self, data: bytes) -> bool:
        """h11 limits only a head that arrives in pieces; this also one that comes in a single read."""
        pending = self.conn.trailing_data[0] + data
        end = pending.find(b"\r\n\r\n", 0, self.limits.max_header_bytes + 4)
        return end == -1 and len(pending) > self.limits.max_header_bytes

    def _arm(self) -> None:
        self._disarm()
        self._waiting_since = self.cycle
        self._deadline = self.loop.call_later(self.limits.read_timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self.conn.their_state is h11.IDLE:  # part of a request's head came, or none at all
            self._close_with(oai.HttpError(408, "request_timeout", f"the request headers did not arrive within "
                                           f"{self.limits.read_timeout:g} s (the gateway's read timeout)"))
        elif not self.transport.is_closing():
            self.transport.close()  # what is left of a request whose answer has gone out

    def _close_with(self, err: oai.HttpError) -> None:
        if not self.transport.is_closing():
            self.transport.write(raw_response(err))
            self.transport.close()


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
