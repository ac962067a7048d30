"""Who sends a request: the one key it carries, the tenant that key names, and the id its request has at the broker.

    HTTP request ──OneKey──▶ two key headers or more (Authorization, x-api-key, in any mix): 400 bad_request
                   │        ──▶ scope["state"]["credential"]: b"Bearer KEY" from either header, b"" with none
                   ▼
    the key check (``app._RequireKey``) ── the credential is a key ──▶ scope["state"]["tenant"] = tenant_of(key)
    the Responses store (``dialect.owner``), the admin check ──▶ the same credential: one key, read once
    handlers ──broker_id(request)──▶ "TAG/ID" for a keyed caller (TAG: its tenant's digest), its own id else

One key header per request: the key check, the Responses store's owner and the admin check must read the same key,
and with two headers each reader would pick its own (the first, or the last), so a valid key would open another
key's namespace. A tenant is ``"key:" + sha256(key)[:16]`` (``tenant_of``): the key itself is never kept or sent.
A gateway without API keys serves the default tenant "" (``tenant``): its callers share one namespace, as before.

Request ids are per tenant: a keyed caller's ``X-Request-Id`` travels to the broker under its tenant's tag
(``broker_id``), so two tenants' ids never collide, and one cannot learn that another's id is pending by reusing it.
Its answers still carry its own id. The console and the monitor show a keyed caller the rows of its own tag only
(``own_id``).
"""

from __future__ import annotations

import hashlib

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import HttpError

KEY_HEADERS = (b"authorization", b"x-api-key")
TAG_SEPARATOR = "/"


def tenant_of(key: str | bytes) -> str:
    """The tenant an API key names, by digest (of its UTF-8 bytes, as a header carries it)."""
    return "key:" + hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()[:16]


def credential(request: Request) -> bytes:
    """The request's one key header, as ``Authorization`` carries it (``b"Bearer KEY"``; b"" without one)."""
    given: bytes = request.scope.get("state", {}).get("credential", b"")
    return given


def tenant(request: Request) -> str:
    """The tenant whose key the request carried ("" when the gateway has no API keys)."""
    found: str = request.scope.get("state", {}).get("tenant", "")
    return found


def is_admin(request: Request) -> bool:
    """Whether the key check let the request through with the admin key (``app._RequireKey``: on the views
    that show every tenant's requests to it)."""
    return bool(request.scope.get("state", {}).get("admin", False))


def tag(tenant_name: str) -> str:
    """What starts a tenant's request ids at the broker ("" for the default tenant)."""
    return tenant_name.removeprefix("key:") + TAG_SEPARATOR if tenant_name else ""


def broker_id(request: Request) -> str:
    """The id the request runs under at the broker: its ``X-Request-Id`` under its tenant's tag."""
    rid: str = request.scope["state"]["request_id"]
    return tag(tenant(request)) + rid


def own_id(broker_side: str, tenant_name: str) -> str | None:
    """``broker_side`` (an id from the slot table) as the tenant's own id, None if it is not the tenant's."""
    prefix = tag(tenant_name)
    return broker_side[len(prefix):] if broker_side.startswith(prefix) else None


class OneKey:
    """ASGI middleware: refuses a request with more than one key header; records the one it carries."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        found = [(name, value) for name, value in scope["headers"] if name in KEY_HEADERS]
        if len(found) > 1:
            names = ", ".join(sorted({name.decode() for name, _ in found}))
            err = HttpError(400, "bad_request", f"the request carries {len(found)} key headers ({names}); send "
                                "exactly one: 'Authorization: Bearer KEY' or 'x-api-key: KEY'")
            await JSONResponse(err.body(), err.status)(scope, receive, send)
            return
        name, value = found[0] if found else (b"", b"")
        scope.setdefault("state", {})["credential"] = value if name == b"authorization" else (
            b"Bearer " + value if value else b"")
        await self.app(scope, receive, send)
