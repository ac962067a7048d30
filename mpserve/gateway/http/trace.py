"""The gateway's span of each HTTP exchange, under the caller's trace (``mpserve.tracing``): present only while
tracing is on (``create_app`` adds it then), so an untraced gateway does not run it at all.

    HTTP request ──traceparent: the caller's span (W3C; a bad one starts a new trace)──▶ span "METHOD /path"
        (server) opened ──▶ tracing.serving(its traceparent): a request this exchange sends to the server continues
        it (``mpserve.client`` reads ``tracing.outgoing``) ──▶ the answer sent (streamed to its end) ──▶ span ended,
        with the status code
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mpserve import tracing

HEADER = b"traceparent"


class Traces:
    """ASGI middleware: a server span per HTTP request, the parent of what the request makes the server do."""

    def __init__(self, app: ASGIApp, tracer: tracing.Tracer) -> None:
        self.app = app
        self._tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(HEADER, b"").decode("latin-1")
        span = self._tracer.open(f"{scope['method']} {scope['path']}", tracing.valid(given), server=True,
                                 attributes={"http.request.method": scope["method"], "url.path": scope["path"]})
        token = tracing.serving(self._tracer.context_of(span))

        async def send_noting(message: Message) -> None:
            if message["type"] == "http.response.start":
                span.set_attribute("http.response.status_code", message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_noting)
        finally:
            request_id = scope.get("state", {}).get("request_id")
            if request_id:
                span.set_attribute("mpserve.request_id", request_id)
            tracing.done(token)
            span.end()
