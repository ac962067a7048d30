"""The OpenAI-compatible HTTP gateway (``mpserve gateway``): HTTP in front, an mpserve client behind.

    HTTP clients ──▶ uvicorn + Starlette (one asyncio loop) ──▶ AsyncClient (one DEALER) ──▶ broker
                        │ for a server on this host: its slot table and /proc (health, monitor, metrics)

    POST /v1/completions, /v1/chat/completions   OpenAI shapes, streamed (server-sent events) or not
    GET  /v1/models                               the served models, and each LoRA adapter as MODEL:NAME (its parent)
    POST /v1/embeddings                           OpenAI's shape (``api.embeddings``), embedding models
    POST /v1/responses, GET|DELETE /v1/responses/{id}   OpenAI's Responses API (``api.responses``)
    POST /v1/messages                             Anthropic's Messages API (``api.messages``); x-api-key too
    POST /v1/rerank, /rerank                      a reranker's scores (``api.rerank``), pooling: rank models
    POST /tokenize, /detokenize                   llama-server's shapes (``api.tokens``)
    GET  /health                                  200 while some instance can take a request, else 503
    GET  /metrics                                 Prometheus text
    GET  /backend/monitor?model=NAME             each instance (process): pid, state, device, RSS, PSS, GPU memory,
                                                  served, uptime, its slots; each GPU's memory (NVML)
    POST /slots/ID?action=save|restore|erase      llama-server's shape: a slot's KV cells to or from a file
                                                  (``ops.slots``; ID as SLOT in mpserve status), with the admin
                                                  key only: a slot holds any tenant's cells
    GET  /, /console, /console/state             the web console and its data (``ops.console``)
    GET  /admin/models, POST /admin/models/NAME/load|unload|scale   the control API, with --admin-key (``ops.admin``)
    GET  /openapi.json                            the OpenAPI document of all this (``api.schema``)

The gateway is a separate process from the server, so HTTP parsing never competes with the broker's loop; it can
start before its server and outlive it (answering 503). Errors are OpenAI's error object with the stable mpserve
code (``http.errors``). Every generating route is one pipeline (``api.dialect``). A streamed request waits for its
first piece of text before it answers, so what fails early (busy queue, unknown model, bad parameters) gets its
own HTTP status; a failure after that is sent as a last ``data: {"error": ...}`` event, as OpenAI does. An HTTP
client that goes away, while queued, running or streaming, cancels its request on the server at once. Bodies are
checked by ``http.limits`` before anything else reads them, connections by ``http.guard``: every limit answers at
once, in OpenAI's shape, naming itself. Every answer carries its request's ``X-Request-Id``: the caller's, or a
new one (``http.request_ids``); a completion or embedding runs under that id on the server, behind its tenant's
tag (``http.keys``).

Tenants: with API keys, each key is a tenant (``http.keys``): a request carries exactly one key header (400
otherwise), its prompts reuse only what its own tenant's prompts computed (or those naming its ``cache_salt``), and
its ids are its own. The console's state and the backend monitor show a key its own requests, /metrics its own
tenant's series; the admin key, let through to those three views, shows every tenant's. /slots and /admin/ take
the admin key alone.

Starlette on uvicorn: the smallest well-kept asyncio stack here, already used by llama-cpp-python's own server,
and it runs on the loop that ``AsyncClient`` needs; requests are parsed by httptools (llhttp, in C:
``http.guard``). What a streamed token costs here is ``http.encode``'s and ``http.guard``'s to keep small: events
built in C, the events of chunks that arrived together sent together, and one socket write per turn of the loop
(uvloop measured no gain beyond the spread between runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from mpserve import __version__, tracing
from mpserve.client import REATTACH_S
from mpserve.errors import ConfigError, ConnectionFailed, ErrorCode, MpserveError, UnknownModel
from mpserve.models.progress import downloads
from mpserve.wire.adapters import SEPARATOR
from mpserve.wire.media import ImageLimits
from mpserve.wire.slots import SlotState, locate

from .api import embeddings as emb
from .api import rerank as rr
from .api import response_store, schema
from .api import tokens as tok
from .api.chat import Renderer, TemplateBudget
from .api.dialect import OpenAI, Pipeline, sole_model
from .api.journal import Journal
from .api.messages import Messages
from .api.messages import error_body as messages_error
from .api.response_store import ResponseStore, StoreBudget
from .api.responses import Responses, stored_routes
from .backend import Backend
from .fleet import PARENT_ENV
from .http import access, keys, limits
from .http.browser import BrowserGuard, host_names
from .http.encode import JSONResponse
from .http.errors import HttpError
from .http.guard import ConnectionLimits, uvicorn_options
from .http.request_ids import RequestIds
from .http.trace import Traces
from .http.watch import ClientGone
from .http.watch import unless_disconnected as _unless_disconnected
from .ops import console, slots
from .ops.admin import ADMIN_PREFIX, Admin
from .ops.metrics import CONTENT_TYPE, GatewayMetrics, ServerView
from .ops.monitor import RestartCounter, gpu_usage, health, monitor, viewer_of

log = logging.getLogger("mpserve.gateway")

SAMPLE_INTERVAL_S = 0.5
# answered without the API key: load balancers probe /health; the console's page holds no data (its state does)
OPEN_PATHS = frozenset({"/health", "/openapi.json", *console.PAGE_PATHS})
SLOTS_PREFIX = "/slots/"  # the admin key's, checked by the route (as /admin/ is)
ADMIN_VIEWS = frozenset({"/console/state", "/backend/monitor", "/metrics"})  # the admin key sees every tenant's there


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    connect: str | None = None  # a ZeroMQ address; None: the local server named server_name
    admin_connect: str | None = None  # the server's admin socket (/admin/, /slots); None: the local server's
    server_name: str = "default"
    api_key: str | None = None
    request_timeout: float | None = None  # seconds per request, queueing included; None: no limit
    reattach: float = REATTACH_S  # seconds its requests (in flight, arriving) wait for a silent server
    curve_server_key: str | None = None  # for a server bound to the network: its public key file
    curve_secret: str | None = None  # and this gateway's secret key file (mpserve keygen)
    log_level: str = "info"
    exit_with_parent: bool = False  # for `mpserve start --http`: stop when the server process is gone
    admin_key: str | None = None  # opens /admin/ (the control API) and nothing else; None: /admin/ is off
    api_keys: tuple[str, ...] = ()  # accepted too (--api-key-file)
    api_key_file: str | None = None  # where api_keys came from: read again on SIGHUP
    ssl_certfile: str | None = None  # with ssl_keyfile: serve https
    ssl_keyfile: str | None = None
    insecure: bool = False  # allow a network host without any key
    connections: ConnectionLimits = ConnectionLimits()  # open connections, header and body read timeouts
    templates: TemplateBudget = TemplateBudget()  # a chat template's render: its time and output (api.chat)
    responses: StoreBudget = StoreBudget()  # the bytes of stored responses, per API key and in all
    images: ImageLimits = ImageLimits()  # a request's images: how many, bytes and pixels each (api.images)
    allowed_origins: tuple[str, ...] = ()  # other origins whose pages may call it ("*": any): http.browser
    allowed_hosts: tuple[str, ...] = ()  # more Host names than those of the address it serves

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.api_key, *self.api_keys) if self.api_key else self.api_keys


def create_app(config: GatewayConfig) -> Starlette:
    gateway = _Gateway(config)
    responses_api = Responses(gateway.responses, gateway.journal)
    routes = [
        *gateway.pipeline.routes([OpenAI("completion"), OpenAI("chat")]),
        Route("/v1/models", gateway.list_models, methods=["GET"]),
        Route("/v1/embeddings", gateway.embeddings, methods=["POST"]),
        Route("/v1/rerank", gateway.rerank, methods=["POST"]),
        Route("/rerank", gateway.rerank, methods=["POST"]),
        Route("/tokenize", gateway.tokenize, methods=["POST"]),
        Route("/detokenize", gateway.detokenize, methods=["POST"]),
        Route("/health", gateway.get_health, methods=["GET"]),
        Route("/metrics", gateway.get_metrics, methods=["GET"]),
        Route("/backend/monitor", gateway.backend_monitor, methods=["GET"]),
        Route("/slots/{slot}", gateway.slot_action, methods=["POST"]),
        Route("/openapi.json", _openapi, methods=["GET"]),
        *gateway.pipeline.routes([responses_api, Messages()]),
        *stored_routes(responses_api, gateway.pipeline),
        *gateway.console.routes(),
        *gateway.admin.routes(),
    ]
    if config.admin_key and config.admin_key == config.api_key:
        raise ConfigError("the admin key must differ from the API key: the API key must not open the control API")
    app = Starlette(routes=routes, lifespan=gateway.lifespan, exception_handlers={HTTPException: _http_error})
    app.state.keys = access.KeyRing(config.api_key, config.api_key_file, config.keys)
    app.state.reload = functools.partial(_reload, app.state.keys, gateway.backend)
    if config.keys:
        app.add_middleware(_RequireKey, ring=app.state.keys, admin_key=config.admin_key)
    app.add_middleware(BrowserGuard, hosts=host_names(config.host, config.allowed_hosts),
                       origins=config.allowed_origins)
    app.add_middleware(keys.OneKey)  # before the key check: it reads the one key this records
    app.add_middleware(RequestIds)  # every answer, a refused one too, carries its X-Request-Id
    tracer = tracing.configure("gateway")
    if tracer is not None:  # outermost: the exchange's span covers the refused requests too
        app.add_middleware(Traces, tracer=tracer)
    return app


def _reload(ring: access.KeyRing, backend: Backend) -> None:
    """A reload (SIGHUP): the API key file read again, and the chat templates asked of the server again at the next
    chat, so that a template the reload changed is in force at once."""
    ring.reload()
    backend.forget_templates()


def check(config: GatewayConfig) -> None:
    """Refuse what must not be served (``ConfigError``): TLS files that do not load, a network address without a
    key; warn of a network address open to anyone."""
    access.check_tls(config.ssl_certfile, config.ssl_keyfile)
    access.check_exposure(config.host, config.keys, config.insecure)
    if not config.keys and not access.loopback(config.host):
        log.warning("listening on %s without an API key: anyone who can reach the port can use the models "
                    "(set --api-key or MPSERVE_API_KEY)", config.host)


def serve(config: GatewayConfig, fd: int | None = None) -> None:
    """Run the gateway in the foreground until SIGINT or SIGTERM: on ``config``'s address, or on the listening
    socket ``fd`` a fleet's parent bound (``fleet``). SIGHUP (a reload) reads the API key file again and asks the
    server for the chat templates again."""
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check(config)
    app = create_app(config)
    signal.signal(signal.SIGHUP, lambda *_: app.state.reload())
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level,
        log_config=None, access_log=config.log_level == "debug",  # log_config None: our log format
        ssl_certfile=config.ssl_certfile, ssl_keyfile=config.ssl_keyfile, **uvicorn_options(config.connections)))
    server.run(sockets=None if fd is None else [socket.socket(fileno=fd)])


class _Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.backend = Backend(config.connect, config.server_name, config.request_timeout, config.curve_server_key,
                               config.curve_secret, config.admin_connect, config.reattach)
        self.metrics = GatewayMetrics()
        self.metrics.waiting_for_server.set_function(lambda: self.backend.waiting)
        self.restarts = RestartCounter()
        self.console = console.Console(self.backend, self.metrics)
        self.admin = Admin(self.backend, config.admin_key)
        self.renderer = Renderer(config.templates)
        stored = response_store.path_for(config.server_name, config.port)
        self.responses = ResponseStore(stored, config.responses)
        self.journal = Journal(stored, config.responses)
        self.pipeline = Pipeline(self.backend, self.metrics, config.connections.read_timeout, self.renderer,
                                 self.journal, config.images)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        sampler = asyncio.create_task(self._sample())
        await anyio.sleep(0)  # loads anyio's asyncio backend (MiBs) now, not on the first request that needs it
        log.info("gateway for %s on http://%s:%d", self.backend.address, self.config.host, self.config.port)
        try:
            yield
        finally:
            sampler.cancel()
            self.renderer.close()
            await self.journal.close()
            self.responses.close()
            await self.backend.close()

    async def _sample(self) -> None:
        """Watch the slot table for restarts and for the console; with ``exit_with_parent``, stop once the
        parent is gone: new connections are left to the next start's gateways (the port is let go at once), and
        the streams in flight go on, waiting for the next server to reattach to (a server killed and started
        again: ``mpserve.client``), then this process exits."""
        parent = int(os.environ.get(PARENT_ENV, os.getppid()))
        while True:
            local = self.backend.read_slots()
            if local is not None:
                self.restarts.observe(local.server, local.rows)
            self.console.observe(local)
            if self.config.exit_with_parent and os.getppid() != parent:
                log.warning("the process that started this gateway is gone; stopping once its streams end")
                os.kill(os.getpid(), signal.SIGTERM)  # once: uvicorn shuts down gracefully (a second would force it)
                return
            await asyncio.sleep(SAMPLE_INTERVAL_S)

    def _failed(self, endpoint: str, exc: MpserveError) -> Response:
        self.metrics.outcome(endpoint, exc.code)
        return _error_response(HttpError.from_mpserve(exc))

    def _unread(self, endpoint: str, exc: limits.Refused | ClientDisconnect) -> Response:
        """The answer to a body that was not read whole: refused (the rest of it is not read, so the connection
        cannot carry another request), or given up by its client (a broken chunk, a hang-up)."""
        if isinstance(exc, ClientDisconnect):
            self.metrics.outcome(endpoint, ErrorCode.CANCELLED)
            return Response(status_code=204)  # nobody reads it
        self.metrics.outcome(endpoint, exc.error.code)
        response = _error_response(exc.error)
        response.headers["connection"] = "close"
        return response


    # --- embeddings and vocabulary ---------------------------------------------------------------

    async def embeddings(self, request: Request) -> Response:
        try:
            call = emb.parse(await limits.read_json(request, self.config.connections.read_timeout))
            client = await self.backend.serving()
            result = await _unless_disconnected(request, client.embed(call.inputs, model=call.model,
                                                                      request_id=keys.broker_id(request)))
        except ClientGone:
            self.metrics.outcome(request.scope["path"], ErrorCode.CANCELLED)
            return Response(status_code=204)
        except MpserveError as exc:
            return self._failed(request.scope["path"], exc)
        except (limits.Refused, ClientDisconnect) as exc:
            return self._unread(request.scope["path"], exc)
        self.metrics.outcome(request.scope["path"], "ok")
        return JSONResponse(emb.answer(result, call.model or sole_model(client), call.encoding_format))

    async def rerank(self, request: Request) -> Response:
        endpoint = "/v1/rerank"  # and its alias /rerank
        try:
            call = rr.parse(await limits.read_json(request, self.config.connections.read_timeout))
            client = await self.backend.serving()
            result = await _unless_disconnected(request, client.rerank(call.query, call.documents, model=call.model,
                                                                         request_id=keys.broker_id(request)))
        except ClientGone:
            self.metrics.outcome(endpoint, ErrorCode.CANCELLED)
            return Response(status_code=204)
        except MpserveError as exc:
            return self._failed(endpoint, exc)
        except (limits.Refused, ClientDisconnect) as exc:
            return self._unread(endpoint, exc)
        self.metrics.outcome(endpoint, "ok")
        return JSONResponse(rr.answer(call, result, call.model or sole_model(client)))

    async def tokenize(self, request: Request) -> Response:
        try:
            call = tok.parse_tokenize(await limits.read_json(request, self.config.connections.read_timeout))
            client = await self.backend.serving()
            result = await client.tokenize(call.content, model=call.model, add_special=call.add_special,
                                           with_pieces=call.with_pieces)
        except MpserveError as exc:
            return self._failed(request.scope["path"], exc)
        except (limits.Refused, ClientDisconnect) as exc:
            return self._unread(request.scope["path"], exc)
        self.metrics.outcome(request.scope["path"], "ok")
        return JSONResponse(tok.tokenize_answer(result, call.with_pieces))

    async def detokenize(self, request: Request) -> Response:
        try:
            model, tokens = tok.parse_detokenize(await limits.read_json(request, self.config.connections.read_timeout))
            client = await self.backend.serving()
            content = await client.detokenize(tokens, model=model)
        except MpserveError as exc:
            return self._failed(request.scope["path"], exc)
        except (limits.Refused, ClientDisconnect) as exc:
            return self._unread(request.scope["path"], exc)
        self.metrics.outcome(request.scope["path"], "ok")
        return JSONResponse({"content": content})

    # --- slots ----------------------------------------------------------------------------------

    async def slot_action(self, request: Request) -> Response:
        """The operator's call: any slot holds any tenant's cells, so only the admin key opens it."""
        refused = self.admin.refused(request)
        if refused is not None:
            self.metrics.outcome("/slots", refused.code)
            return _error_response(refused)
        try:
            slot, action = slots.parse(request.path_params["slot"], request.query_params.get("action"))
            name = "" if action == "erase" else slots.filename(
                await limits.read_json(request, self.config.connections.read_timeout))
            local = self.backend.read_slots()
            if local is None:
                raise ConnectionFailed(f"slot ids are rows of the slot table of a server on this host; none is "
                                       f"running at {self.backend.address}")
            worker, own = locate(local.rows, slot)
            client = await self.backend.admin()
            reply = await client.slot(action, worker, own, name)
        except MpserveError as exc:
            return self._failed("/slots", exc)
        self.metrics.outcome("/slots", "ok")
        return JSONResponse(slots.answer(slot, name, reply))

    # --- monitoring -----------------------------------------------------------------------------

    async def list_models(self, request: Request) -> Response:
        stats = await self.backend.stats()
        if stats is None:
            return _error_response(HttpError.from_mpserve(self._unreachable()))
        local = self.backend.read_slots()
        created = int(local.server.started) if local is not None else 0
        return JSONResponse({"object": "list", "data": [
            entry for name, model in stats.models.items() for entry in [
                {"id": name, "object": "model", "created": created, "owned_by": "mpserve"},
                *({"id": f"{name}{SEPARATOR}{adapter}", "object": "model", "created": created, "owned_by": "mpserve",
                   "parent": name} for adapter in model.adapters)]]})

    async def get_health(self, request: Request) -> Response:
        stats = await self.backend.stats()
        if stats is None:
            return JSONResponse({"status": "unavailable", "accepting": False,
                                 "reason": self._unreachable().message, "models": {}}, 503)
        local = self.backend.read_slots()
        models = health(stats, local.rows if local is not None else None)
        ok = stats.accepting and any(m.can_serve for m in models.values())
        reason = None if ok else "the server is shutting down" if not stats.accepting else "no instance is ready"
        return JSONResponse({"status": "ok" if ok else "unavailable", "accepting": stats.accepting, "reason": reason,
                             "models": {name: asdict(m) for name, m in models.items()}}, 200 if ok else 503)

    async def get_metrics(self, request: Request) -> Response:
        stats = await self.backend.stats()
        local = self.backend.read_slots() if stats is not None else None
        gpus = await asyncio.to_thread(gpu_usage, local.rows) if local is not None else None
        view = ServerView(stats, local.rows if local is not None else None, dict(self.restarts.counts), gpus,
                          viewer_of(request))
        return Response(self.metrics.render(view), media_type=CONTENT_TYPE)

    async def backend_monitor(self, request: Request) -> Response:
        local = self.backend.read_slots()
        if local is None and downloads():  # a server that is still downloading its models: what it downloads
            return JSONResponse(await asyncio.to_thread(monitor, [], None))
        if local is None:
            return _error_response(HttpError.from_mpserve(ConnectionFailed(
                f"the backend monitor reads the slot table of a server on this host; none is running at "
                f"{self.backend.address}")))
        model = request.query_params.get("model")
        served = sorted({r.model for r in local.rows if r.state is not SlotState.EMPTY})
        if model is not None and model not in served:
            return _error_response(HttpError.from_mpserve(UnknownModel(
                f"model {model!r} is not served here; served models: {', '.join(served)}")))
        # /proc/PID/smaps_rollup walks the process's page tables, NVML is a driver call: off the event loop
        rows, viewer = local.rows, viewer_of(request)
        return JSONResponse(await asyncio.to_thread(lambda: monitor(rows, model, gpu_usage(rows), viewer)))

    def _unreachable(self) -> ConnectionFailed:
        return ConnectionFailed(f"no mpserve server answers at {self.backend.address}")


# --- helpers ------------------------------------------------------------------------------------

async def _openapi(request: Request) -> Response:
    return JSONResponse(schema.document(__version__))


def _error_response(err: HttpError) -> JSONResponse:
    return JSONResponse(err.body(), err.status, headers=err.headers())


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no such route, wrong method) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return _error_response(HttpError(exc.status_code, code, f"{request.method} {request.url.path}: {exc.detail}"))


class _RequireKey:
    """Answer 401 unless the request carries ``Authorization: Bearer KEY`` with one of the keys (what OpenAI
    clients send), or ``x-api-key: KEY`` (what Anthropic's send; its 401 in Anthropic's shape): the one key
    header ``keys.OneKey`` recorded. The key's tenant goes into the request's state. On ``ADMIN_VIEWS`` the admin
    key passes too, as the admin's. The comparison takes the same time wherever the keys differ."""

    def __init__(self, app: ASGIApp, ring: access.KeyRing, admin_key: str | None = None) -> None:
        self.app = app
        self._ring = ring  # read at each request: a reload (SIGHUP) changes its keys
        self._admin = (f"Bearer {admin_key}".encode(),) if admin_key else ()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path and path not in OPEN_PATHS and not path.startswith((ADMIN_PREFIX, SLOTS_PREFIX)):
            state = scope.setdefault("state", {})
            given: bytes = state.get("credential", b"")
            if path in ADMIN_VIEWS and access.any_matches(given, self._admin):
                state["admin"] = True
            elif access.any_matches(given, self._ring.expected):
                state["tenant"] = keys.tenant_of(given.removeprefix(b"Bearer "))
            else:
                err = HttpError(401, "invalid_api_key", "a valid API key is required: send the header "
                                    "'Authorization: Bearer KEY' (or 'x-api-key: KEY')")
                body = messages_error(err) if scope["path"] == Messages.path else err.body()
                await JSONResponse(body, err.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)
