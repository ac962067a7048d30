"""The id of each HTTP request: the caller's ``X-Request-Id`` (for tracing), checked, or a new one; every answer
carries it in its own ``X-Request-Id`` header, and a generation or embedding request travels under it, so the
slot table, the console and the server's log show the same id.

    HTTP request ──X-Request-Id: the caller's (checked), or a new unique one──▶ request.state.request_id
                                                                               │ the handler's request_id=
    HTTP answer ◀── X-Request-Id: the same ◀───────────────────────────────────┘

A caller's id is 1 to ``REQUEST_ID_CHARS`` letters, digits and ``._:@/+=-``; any other value is answered 400
(``bad_request``) before the request is read. An id still pending on the gateway's connection (two requests of
a caller under one id at once) is refused as a duplicate (400).
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mpserve.client import check_request_id, request_ids
from mpserve.errors import BadRequest

from .errors import HttpError

HEADER = b"x-request-id"


class RequestIds:
    """ASGI middleware: sets ``scope["state"]["request_id"]`` and the answer's ``X-Request-Id``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._ids = request_ids()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(HEADER)
        try:
            rid = next(self._ids) if given is None else check_request_id(given.decode("latin-1"))
        except BadRequest as exc:
            err = HttpError.from_mpserve(BadRequest(f"X-Request-Id: {exc.message}"))
            await JSONResponse(err.body(), err.status)(scope, receive, send)
            return
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (HEADER, rid.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)
