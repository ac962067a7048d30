"""What a web browser may do with the gateway: an ASGI middleware, outermost, that refuses before any route or
key check what a page the user has open elsewhere could make the browser send.

    request ─▶ Host ─────────── not a name of the address the gateway serves ─▶ 403 invalid_host
             │                   (DNS rebinding: evil.example resolving to 127.0.0.1)
             ├▶ Origin ───────── another origin, not in --allowed-origins ─▶ 403 cross_origin (no CORS headers)
             │                   an allowed one: CORS headers on the answer; its preflight (OPTIONS) answered here
             ├▶ Content-Type ─── a POST with a body that is not application/json ─▶ 415 unsupported_media_type
             │                   (a cross-site form, text/plain, sends no preflight)
             ▼
           the app (key check, routes)

The rules follow Ollama's (``OLLAMA_ORIGINS`` and its Host check). A gateway bound to a loopback address takes
the loopback names (localhost, 127.0.0.1, [::1]) and ``--allowed-hosts``; one bound to a specific address,
that address, this host's names and ``--allowed-hosts``; one bound to every address (0.0.0.0, ::) checks no
Host (it needs an API key unless --insecure). Requests without an Origin (curl, SDKs, the console's own page
reading with GET) pass: only browsers send it, and they send it on every cross-origin request and every POST.
Errors are OpenAI's error object.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from . import access
from .errors import HttpError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
_CORS_METHODS = b"GET, POST, OPTIONS"
_CORS_HEADERS = b"Authorization, Content-Type"
_JSON = "application/json"


def host_names(bound: str, extra: tuple[str, ...] = ()) -> frozenset[str] | None:
    """The Host names a gateway bound to ``bound`` answers; None: any (bound to every address)."""
    extra_names = {name.lower() for name in extra}
    if bound in ("", "0.0.0.0", "::", "[::]"):
        return None
    if access.loopback(bound) or bound.lower() == "localhost":
        return frozenset(_LOOPBACK_NAMES | extra_names | {bound.lower()})
    names = {bound.lower(), f"[{bound}]" if _is_ipv6(bound) else bound.lower(), socket.gethostname().lower(),
             socket.getfqdn().lower()}
    return frozenset(names | extra_names)


class BrowserGuard:
    def __init__(self, app: App, hosts: frozenset[str] | None, origins: tuple[str, ...]) -> None:
        """``hosts``: the Host names taken (``host_names``; None: any); ``origins``: the other origins whose pages
        may call the gateway ("*": any)."""
        self.app = app
        self._hosts = hosts
        self._any_origin = "*" in origins
        self._origins = frozenset(o.rstrip("/").lower() for o in origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k: v for k, v in scope["headers"] if k in (b"host", b"origin", b"content-type",
                                                                b"content-length", b"transfer-encoding")}
        host = headers.get(b"host", b"").decode("latin-1")
        if self._hosts is not None and host and _hostname(host) not in self._hosts:
            await _refuse(send, 403, "invalid_host", f"Host {host!r} is not an address this gateway serves; "
                          "use its address, or start it with --allowed-hosts naming this one")
            return
        origin = headers.get(b"origin", b"").decode("latin-1").rstrip("/").lower()
        cross = bool(origin) and origin != f"{scope.get('scheme', 'http')}://{host.lower()}"
        if cross and not (self._any_origin or origin in self._origins):
            await _refuse(send, 403, "cross_origin", f"requests from pages of {origin} are refused; start the "
                          "gateway with --allowed-origins naming it to allow them")
            return
        if cross and scope["method"] == "OPTIONS":
            await _preflight(send, origin)
            return
        if scope["method"] == "POST" and not _json_or_empty(headers):
            await _refuse(send, 415, "unsupported_media_type", "a POST body must be JSON: send it with the header "
                          "'Content-Type: application/json'", cors=origin if cross else None)
            return
        if not cross:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *_cors(origin)]
            await send(message)

        await self.app(scope, receive, send_with_cors)


def _hostname(host: str) -> str:
    """The Host header without its port: ``[::1]:8000`` -> ``[::1]``, ``localhost:8000`` -> ``localhost``."""
    host = host.lower()
    if host.startswith("["):
        return host[:host.find("]") + 1]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).version == 6
    except ValueError:
        return False


def _json_or_empty(headers: dict[bytes, bytes]) -> bool:
    content_type = headers.get(b"content-type")
    if content_type is None:
        return headers.get(b"content-length", b"0") == b"0" and b"transfer-encoding" not in headers
    return content_type.split(b";", 1)[0].strip().lower().decode("latin-1") == _JSON


def _cors(origin: str) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]


async def _preflight(send: Send, origin: str) -> None:
    headers = [*_cors(origin), (b"access-control-allow-methods", _CORS_METHODS),
               (b"access-control-allow-headers", _CORS_HEADERS), (b"access-control-max-age", b"600"),
               (b"content-length", b"0")]
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


async def _refuse(send: Send, status: int, code: str, message: str, cors: str | None = None) -> None:
    body = json.dumps(HttpError(status, code, message).body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *(_cors(cors) if cors else [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
