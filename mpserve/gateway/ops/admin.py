"""The control API over HTTP, behind its own key (``--admin-key``), apart from the inference key.

    GET  /admin/models              every model: instances taking requests, starting, draining; bounds; state
    POST /admin/models              {"path": "/m.gguf", "name": "m", "min": 1, "max": 2}: serve another model
    POST /admin/models/NAME/load    start its instances (min at least 1)
    POST /admin/models/NAME/unload  drain them all (min 0: the next request loads it again)
    POST /admin/models/NAME/scale   {"min": 1, "max": 4}, either or both
    GET  /admin/adapters            each model's LoRA adapters, in the order of their ids
    POST /admin/adapters            {"model": "m", "name": "fr", "path": "/fr.gguf"}: load one into every instance
    DELETE /admin/adapters/MODEL/NAME  unload one, once the requests using it have finished (ADAPTER_ACTION)

    HTTP ──Bearer ADMIN_KEY──▶ Admin ──CONTROL, on the admin socket──▶ broker (mpserve.server.instances)
                                          ──CONTROL_REPLY──▶ JSON

An answer is ``{"message": ..., "models": [...]}``; an error is OpenAI's error object with the stable code
(404 ``unknown_model``, 400 ``bad_request``, 503 ``does_not_fit``, ...). Without an admin key every /admin/
path answers 404: the control API is off. The inference key never opens these paths, and the admin key opens
only these, /slots (a slot's cells to and from files: any tenant's) and, as the admin's, the console's state and
the backend monitor.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import asdict
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mpserve.errors import BadRequest, ConnectionFailed, MpserveError
from mpserve.wire import protocol as wire

from ..backend import Backend
from ..http import keys
from ..http.errors import HttpError

ADMIN_PREFIX = "/admin/"
_OPS = ("load", "unload", "scale")


class Admin:
    def __init__(self, backend: Backend, key: str | None) -> None:
        self._backend = backend
        self._expected = f"Bearer {key}".encode() if key else None

    def routes(self) -> list[Route]:
        return [Route("/admin/models", self.models, methods=["GET"]),
                Route("/admin/models", self.add, methods=["POST"]),
                Route("/admin/models/{name}/{op}", self.call, methods=["POST"]),
                Route("/admin/adapters", self.adapters, methods=["GET", "POST"]),
                Route("/admin/adapters/{model}/{name}", self.unload_adapter, methods=["DELETE"])]

    async def adapters(self, request: Request) -> Response:
        """GET: each model's adapters; POST: load one."""
        refused = self.refused(request)
        if refused is not None:
            return _error(refused)
        try:
            if request.method == "GET":
                stats = await self._backend.stats()
                if stats is None:
                    raise ConnectionFailed(f"no mpserve server answers at {self._backend.address}")
                return JSONResponse({name: m.adapters for name, m in stats.models.items()})
            given = await _adapter_body(request)
            client = await self._backend.admin()
            reply = await client.adapter("load", given["model"], given["name"], given["path"])
        except MpserveError as exc:
            return _error(HttpError.from_mpserve(exc))
        return JSONResponse(msgspec.structs.asdict(reply))

    async def unload_adapter(self, request: Request) -> Response:
        refused = self.refused(request)
        if refused is not None:
            return _error(refused)
        try:
            client = await self._backend.admin()
            reply = await client.adapter("unload", request.path_params["model"], request.path_params["name"])
        except MpserveError as exc:
            return _error(HttpError.from_mpserve(exc))
        return JSONResponse(msgspec.structs.asdict(reply))

    async def models(self, request: Request) -> Response:
        return await self._control(request, "models")

    async def add(self, request: Request) -> Response:
        return await self._control(request, "add")

    async def call(self, request: Request) -> Response:
        op = request.path_params["op"]
        if op not in _OPS:
            return _error(HttpError(404, "not_found", f"no admin call {op!r}; calls: {', '.join(_OPS)}"))
        return await self._control(request, op, request.path_params["name"])

    async def _control(self, request: Request, op: str, model: str | None = None) -> Response:
        refused = self.refused(request)
        if refused is not None:
            return _error(refused)
        try:
            given = await _body(request, op) if op in ("scale", "add") else {}
            client = await self._backend.admin()
            reply = await client.control(op, given.pop("name", model), **given)
        except MpserveError as exc:
            return _error(HttpError.from_mpserve(exc))
        return JSONResponse({"message": reply.message, "models": [asdict(m) for m in reply.models]})

    def refused(self, request: Request) -> HttpError | None:
        """Why ``request`` may not make an operator's call (/admin/, /slots), None if it may: it carries the admin
        key, as its one key header (``keys.credential``)."""
        if self._expected is None:
            return HttpError(404, "not_found", "the operator's calls (/admin/, /slots) are off; start the gateway "
                                 "with --admin-key")
        if not hmac.compare_digest(keys.credential(request), self._expected):
            return HttpError(401, "invalid_admin_key", "a valid admin key is required: send the header "
                                 "'Authorization: Bearer ADMIN_KEY'")
        return None


BODIES = {"scale": ({"min", "max"}, '{"min": 1, "max": 4}'),
          "add": ({"path", "name", "min", "max"}, '{"path": "/models/m.gguf", "name": "m", "min": 1, "max": 2}')}
"""The fields of a model call's body (the OpenAPI document lists each), and an example."""
ADAPTER_FIELDS = frozenset({"model", "name", "path"})  # a LoRA adapter load's body, each field required


async def _body(request: Request, op: str) -> dict[str, Any]:
    """The call's JSON object; checked here for shape, by ``wire.Control`` for the rest."""
    keys, example = BODIES[op]
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        raise BadRequest(f"the body must be a JSON object like {example}") from None
    if not isinstance(body, dict) or set(body) - keys:
        raise BadRequest(f"the body must be a JSON object with keys among {', '.join(sorted(keys))}, like {example}")
    for key, value in body.items():
        text = key in ("path", "name")
        if not isinstance(value, str if text else int) or isinstance(value, bool):
            raise BadRequest(f"'{key}' must be {'a string' if text else 'an integer'}, got {value!r}")
    wire.Control("check", op, body.get("name", "model"), body.get("min"), body.get("max"), body.get("path")).validate()
    return body


async def _adapter_body(request: Request) -> dict[str, str]:
    example = '{"model": "m", "name": "fr", "path": "/adapters/fr.gguf"}'
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        raise BadRequest(f"the body must be a JSON object like {example}") from None
    if not isinstance(body, dict) or set(body) != ADAPTER_FIELDS or not all(
            isinstance(v, str) for v in body.values()):
        raise BadRequest(f"the body must be a JSON object of the strings model, name and path, like {example}")
    return body


def _error(err: HttpError) -> JSONResponse:
    return JSONResponse(err.body(), err.status, headers=err.headers())
