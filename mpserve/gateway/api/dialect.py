"""The generation pipeline: every endpoint that generates text is a dialect of it. OpenAI's completions and
chat completions are the plain case (``OpenAI``: the request is the call, the answer is the completion);
OpenAI's Responses (``responses``) and Anthropic's Messages (``messages``) translate into a chat call and out
of the chat completion, so templates, tools, structured output, limits, the broker path and metrics are one.

    HTTP body ──limits──▶ Dialect.parse ──▶ Answer (its Call: openai.parse, of the translated body for a dialect)
        ──▶ its images within the gateway's limits (``ImageLimits``: how many, bytes and pixels each; 400 past them)
        ──▶ prepared: a chat's prompt from the model's chat template; an echoed token prompt's text
        ──▶ AsyncClient.choices / stream, with the call's GenerateParams as they are ──▶ the broker
    results ──openai.Reply──▶ the completion, or its chunks ──Answer──▶ the dialect's object, or events
    any failure ──▶ Dialect.error_body: the dialect's own error shape, with the status of HttpError

A streamed answer starts once its first text is ready, so what fails early (busy queue, unknown model, bad
parameters) gets its own status; a failure after that is the stream's last event (``Answer.failed``). The
events of chunks that arrived together leave in one send. A client that leaves, while queued, running or
streaming, cancels its request. ``owner`` names whose API key sent a request, for what a dialect keeps per key.

A stream whose caller named it (``X-Request-Id``), and a background response, is resumable (``journal``): its
generation runs in a task of its own, each event is journaled with its ``id:``, and the answer reads the journal:

    stream + the caller's X-Request-Id ──▶ Journal.begin ──▶ Journal.produce(the events) ──▶ EventStream(tail)
    the same request + Last-Event-ID: N ──▶ EventStream(Journal.tail after N), no new generation
        its producing process died ──▶ Journal.take_over ──▶ the request again, with the text its events had
        (``AsyncClient.stream(delivered=…)``), the answer's state replayed from their pieces ──▶ Journal.produce
    a background response ──▶ produced to its end whoever reads it; the POST answers at once (``background``)

Every dialect takes vLLM's ``cache_salt`` (``take_cache_salt``): the requests that name one may reuse each other's
cached prefixes, whoever sends them. Without it a request reuses only what its own tenant's requests computed (the
tenant of its API key, ``http.keys``; one tenant for all when the gateway has no keys). A request runs at the broker
under its tenant and its id under the tenant's tag (``keys.broker_id``).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from mpserve.client import AsyncClient, Result, Stream
from mpserve.errors import BadRequest, ErrorCode, MpserveError
from mpserve.wire import adapters as wire_adapters
from mpserve.wire import protocol as wire
from mpserve.wire.media import ImageLimits, check_images
from mpserve.wire.salt import fallback_salt

from ..backend import Backend
from ..http import encode, keys, limits
from ..http.encode import EventStream, JSONResponse
from ..http.errors import HttpError
from ..http.watch import ClientGone, first, unless_disconnected
from ..ops.metrics import GatewayMetrics
from . import openai as oai
from .chat import Renderer
from .journal import Journal, NoStream, Pieces, Taken


class Answer(Protocol):
    """One request in a dialect: its call, and its answer built from the completion's."""

    call: oai.Call

    def whole(self, completion: dict[str, Any]) -> dict[str, Any]:
        """The dialect's object from the completion (``openai.Reply.whole``)."""

    def opened(self, model: str) -> list[bytes]:
        """The events that start a stream, before its first chunk."""

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        """The events of one completion chunk (``openai.Reply.chunks``)."""

    def closed(self, last: list[dict[str, Any]], results: list[Result]) -> list[bytes]:
        """The events from the last chunks (``openai.Reply.last``: held tool calls, the finish reason) to the
        stream's end; ``results`` for the usage."""

    def failed(self, error: HttpError) -> bytes:
        """The event that ends a stream that failed."""


class Dialect(Protocol):
    path: str  # the route, and the endpoint label of its metrics

    def parse(self, body: Any, owner: str) -> Answer:
        """Check a body and translate it; raises BadRequest naming the field (the dialect's name for it)."""

    def error_body(self, error: HttpError) -> dict[str, Any]:
        """An error in the dialect's shape."""


class Revivable(Dialect, Protocol):
    """A dialect with background answers, which another gateway process can take over (``Pipeline.revive``)."""

    def resumed(self, body: Any, owner: str, head: bytes) -> Answer:
        """``body`` parsed again as the background answer whose object was ``head`` (its id, its creation)."""


class OpenAI:
    """The plain dialect: OpenAI's completions (``kind`` completion) or chat completions, as they are."""

    def __init__(self, kind: oai.Kind) -> None:
        self.kind = kind
        self.path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"

    def parse(self, body: Any, owner: str) -> Plain:
        return Plain(oai.parse(self.kind, body))

    @staticmethod
    def error_body(error: HttpError) -> dict[str, Any]:
        return error.body()


@dataclass
class Plain:
    """An OpenAI request's answer: the completion itself, its chunks as ``data:`` events, then ``[DONE]``."""

    call: oai.Call

    @staticmethod
    def whole(completion: dict[str, Any]) -> dict[str, Any]:
        return completion

    @staticmethod
    def opened(model: str) -> list[bytes]:
        return []

    @staticmethod
    def chunk(chunk: dict[str, Any]) -> list[bytes]:
        return [encode.event(chunk)]

    @staticmethod
    def closed(last: list[dict[str, Any]], results: list[Result]) -> list[bytes]:
        return [encode.events(last), encode.DONE]

    @staticmethod
    def failed(error: HttpError) -> bytes:
        return encode.event(error.body())


def event(name: str, data: dict[str, Any]) -> bytes:
    """A server-sent event with its name (``event:``), as the Responses and Messages streams send them."""
    return b"event: " + name.encode() + b"\ndata: " + json.dumps(data, separators=(",", ":"),
                                                                 ensure_ascii=False).encode() + b"\n\n"


def finish_reason(last: list[dict[str, Any]]) -> str:
    """The finish reason the last chat chunks (``openai.Reply.last``) carry."""
    return next((c["finish_reason"] for chunk in last for c in chunk["choices"] if c.get("finish_reason")), "stop")


def owner(request: Request) -> str:
    """Who sent the request, for what is kept per API key: a digest of the one key it carried (``Authorization:
    Bearer`` or ``x-api-key``, ``keys.credential``: the key the key check read), "" without one."""
    given = keys.credential(request).removeprefix(b"Bearer ")
    return hashlib.sha256(given).hexdigest()[:32] if given else ""


_FALLBACK_SECRET = secrets.token_bytes(16)  # this process's key of a tenant's fallback salt (``fallback_salt``)


PIPELINE_FIELDS = frozenset({"cache_salt", "priority"})
"""The fields every dialect's body may carry that the pipeline takes out before the dialect reads it."""


def take_cache_salt(body: Any) -> str | None:
    """The body's ``cache_salt``, taken out of it (the dialects' own fields do not hold it); None without one."""
    if not isinstance(body, dict):
        return None  # the dialect refuses the body
    salt = body.pop("cache_salt", None)
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= wire.MAX_CACHE_SALT_CHARS):
        raise BadRequest(f"'cache_salt' must be a non-empty string of at most {wire.MAX_CACHE_SALT_CHARS} "
                         f"characters, got {str(salt)[:40]!r}")
    return salt


def take_priority(body: Any) -> int:
    """The body's ``priority`` (vLLM's and SGLang's field: higher is more urgent), taken out of it; 0 without one.
    The broker caps it at the caller's tenant's ``max_priority``."""
    if not isinstance(body, dict):
        return 0
    priority = body.pop("priority", None)
    if priority is None:  # null: not given, as every field
        return 0
    if not isinstance(priority, int) or isinstance(priority, bool) or not -100 <= priority <= 100:
        raise BadRequest(f"'priority' must be an integer from -100 to 100 (higher is more urgent), got "
                         f"{str(priority)[:40]!r}")
    return priority


def sole_model(client: AsyncClient) -> str:
    """The model a request that names none runs on (the broker refuses it when several are served)."""
    return client.models[0] if len(client.models) == 1 else ""


class Pipeline:
    """Serves each dialect's route through the gateway's backend and metrics."""

    def __init__(self, backend: Backend, metrics: GatewayMetrics, read_timeout: float, renderer: Renderer,
                 journal: Journal, images: ImageLimits) -> None:
        self.backend = backend
        self.images = images
        self.metrics = metrics
        self.read_timeout = read_timeout
        self.renderer = renderer
        self.journal = journal

    def routes(self, dialects: Sequence[Dialect]) -> list[Route]:
        """A POST route per dialect, at its path."""
        def endpoint(dialect: Dialect) -> Callable[[Request], Awaitable[Response]]:
            async def serve(request: Request) -> Response:
                return await self.serve(request, dialect)
            return serve
        return [Route(d.path, endpoint(d), methods=["POST"]) for d in dialects]

    async def serve(self, request: Request, dialect: Dialect) -> Response:
        endpoint, started = dialect.path, time.perf_counter()
        try:
            body = await limits.read_json(request, self.read_timeout)
            limits.check_sizes(body)
            cache_salt, priority = take_cache_salt(body), take_priority(body)
            answer = dialect.parse(body, owner(request))
            check_images(answer.call.chat_images(), self.images)
            resumed = None  # the stream a Last-Event-ID resumes, whose producing process died: taken over
            if request.headers.get("last-event-id") is not None:
                resumed = self._resumed(request, body, request.headers["last-event-id"])
                if self.journal.stream(owner(request), resumed[0]).state != "orphaned":
                    return EventStream(self._tail(answer, owner(request), *resumed), answer.call.headers())
            client, reply, ask = await self._asked(request, answer, cache_salt, priority)
        except NoStream as exc:
            return JSONResponse(HttpError(404, "not_found", exc.message).body(), 404)
        except MpserveError as exc:
            return self._failed(dialect, exc)
        except limits.Refused as exc:
            self.metrics.outcome(endpoint, exc.error.code)
            response = self._error(dialect, exc.error)
            response.headers["connection"] = "close"  # the rest of the body is not read
            return response
        except ClientDisconnect:  # a broken chunk, a hang-up
            self.metrics.outcome(endpoint, ErrorCode.CANCELLED)
            return Response(status_code=204)  # nobody reads it
        call, rid = answer.call, ask.request_id
        if resumed is not None:
            return self._take_over(request, dialect, answer, reply, client, resumed, started, ask)
        background = getattr(answer, "background", None)
        if background is not None:
            asked = json.dumps({"body": body, "cache_salt": cache_salt, "priority": priority}).encode()
            return await self._background(request, dialect, answer, reply, client, background, ask, asked)
        key = request.headers.get("x-request-id") if call.stream else None  # the caller's: resumable
        try:
            if key is not None:
                return await self._resumable(request, dialect, answer, reply, client, key, body, started, ask)
            if call.stream:
                stream = client.stream(call.prompt, model=call.model, request_id=rid, params=call.params,
                                       cache_salt=ask.cache_salt, tenant=ask.tenant, adapters=ask.adapters,
                                       priority=ask.priority)
                chunks = stream.__aiter__()  # submits the request on its first step
                text = await unless_disconnected(request, first(chunks))
                return EventStream(self._events(dialect, answer, reply, stream, chunks, text, started, ask.counted),
                                   call.headers())
            results = await unless_disconnected(request, client.choices(
                call.prompt, model=call.model, request_id=rid, params=call.params, cache_salt=ask.cache_salt,
                tenant=ask.tenant, adapters=ask.adapters, priority=ask.priority))
        except ClientGone:
            self.metrics.outcome(endpoint, ErrorCode.CANCELLED)
            return Response(status_code=204)  # nobody reads it
        except MpserveError as exc:
            return self._failed(dialect, exc)
        self._done(endpoint, ask.counted, results, started)
        return JSONResponse(answer.whole(reply.whole(call.shown(results), results)), headers=call.headers())

    async def _asked(self, request: Request, answer: Answer, cache_salt: str | None, priority: int
                     ) -> tuple[AsyncClient, oai.Reply, Ask]:
        """The client (the caller's tenant's), the reply and the ask for ``answer``, its call prepared (a chat's
        prompt from the model's template)."""
        client, tenant = await self.backend.for_tenant(keys.tenant(request))
        if keys.tenant(request) and not tenant:  # sent as the gateway's own: its prompts still kept apart
            cache_salt = fallback_salt(_FALLBACK_SECRET, keys.tenant(request), cache_salt)
        model = answer.call.model or sole_model(client)  # BASE:NAME names an adapter: answered with it
        base = wire_adapters.split_model(model)[0] or model
        adapters = await self._adapters(answer.call, base)
        chosen = base, wire_adapters.selection(model, adapters)[1]  # what the metrics count it under
        answer.call = await self._prepared(answer.call, client, base)
        return client, oai.Reply(answer.call, model), Ask(keys.broker_id(request), cache_salt, tenant, adapters,
                                                          chosen, priority)

    async def _resumable(self, request: Request, dialect: Dialect, answer: Answer, reply: oai.Reply,
                         client: AsyncClient, key: str, body: Any, started: float, ask: Ask) -> Response:
        """A stream under the caller's id, journaled: it runs on for GRACE_S if its client leaves, and a request
        with the same id and body and ``Last-Event-ID`` reads on (``_resume``)."""
        who, call = owner(request), answer.call
        self.journal.begin(who, key, _digest(body))
        try:
            stream = client.stream(call.prompt, model=call.model, params=call.params, request_id=ask.request_id,
                                   cache_salt=ask.cache_salt, tenant=ask.tenant, adapters=ask.adapters,
                                   priority=ask.priority)
            chunks = stream.__aiter__()
            text = await unless_disconnected(request, first(chunks))
        except BaseException:
            self.journal.forget(who, key)
            raise
        fed: Pieces = []
        self.journal.produce(who, key, self._events(dialect, answer, reply, stream, chunks, text, started,
                                                    ask.counted, fed), fed=fed)
        return EventStream(self._tail(answer, who, key, -1), call.headers())

    def _resumed(self, request: Request, body: Any, given: str) -> tuple[str, int]:
        """The key of the stream a request with ``Last-Event-ID: given`` resumes (its caller's ``X-Request-Id``), and
        the event it read last; BadRequest if it cannot be, NoStream if there is none."""
        key = request.headers.get("x-request-id")
        if key is None:
            raise BadRequest("Last-Event-ID resumes a stream by its X-Request-Id: send the same X-Request-Id as the "
                             "request it resumes")
        if not given.strip().isdigit():
            raise BadRequest(f"Last-Event-ID must be the id of an event of the stream (a number), got {given!r:.40}")
        if self.journal.stream(owner(request), key).digest != _digest(body):
            raise BadRequest(f"the stream with X-Request-Id {key!r} was another request: resume it with its own "
                             "body, or use another id for this one")
        return key, int(given)

    def _take_over(self, request: Request, dialect: Dialect, answer: Answer, reply: oai.Reply, client: AsyncClient,
                   resumed: tuple[str, int], started: float, ask: Ask) -> Response:
        """A stream whose producing gateway process died, produced on here: the request sent again with the text
        its journaled events had, which comes again and is dropped; its answer's state replayed from the pieces
        of text it had taken. If another process took it over first, or it cannot be, it is read as it is."""
        (key, after), who, call = resumed, owner(request), answer.call
        taken = self.journal.take_over(who, key)
        if taken is not None:
            self._produce(dialect, answer, reply, client, ask, who, key, started, taken, background=False)
        return EventStream(self._tail(answer, who, key, after), call.headers())

    async def _background(self, request: Request, dialect: Dialect, answer: Answer, reply: oai.Reply,
                          client: AsyncClient, background: Background, ask: Ask, asked: bytes) -> Response:
        """A response produced to its end in a task of its own, whoever reads it; the POST answers at once: the
        response in progress, or its stream (read on with ``GET …?stream=true&starting_after=N``). ``asked``: its
        request, journaled for a takeover (``revive``)."""
        who, key = owner(request), background.key
        self.journal.begin(who, key, key, background.head, asked)
        self._produce(dialect, answer, reply, client, ask, who, key, time.perf_counter(), None, background=True)
        if answer.call.stream:
            return EventStream(self._tail(answer, who, key, -1), answer.call.headers())
        return JSONResponse(json.loads(background.head), headers=answer.call.headers())

    def _produce(self, dialect: Dialect, answer: Answer, reply: oai.Reply, client: AsyncClient, ask: Ask, who: str,
                 key: str, started: float, taken: Taken | None, background: bool) -> None:
        """Run ``answer``'s call, streamed, into the journal as stream ``key`` (``Journal.produce``); ``taken``: from
        where its dead producer left it (its text dropped as it comes again, the answer's state replayed)."""
        call = replace(answer.call, stream=True)
        stream = client.stream(call.prompt, model=call.model, params=call.params, request_id=ask.request_id,
                               cache_salt=ask.cache_salt, tenant=ask.tenant, adapters=ask.adapters,
                               priority=ask.priority, delivered=_delivered(taken.pieces) if taken is not None else None)
        fed: Pieces = []
        self.journal.produce(who, key, self._events(dialect, answer, oai.Reply(call, reply.model), stream,
                                                    stream.__aiter__(), None, started, ask.counted, fed,
                                                    replay=taken.pieces if taken is not None else None),
                             background=background, fed=fed, start=taken.next_seq if taken is not None else 0)

    async def revive(self, request: Request, dialect: Revivable, key: str) -> None:
        """A background response whose gateway process died, taken over by this one (any reader of it does this):
        its journaled request sent again, the text it had made dropped as it comes again, its answer's state
        replayed; a request that cannot be sent again ends it with the dialect's error event."""
        who = owner(request)
        taken = self.journal.take_over(who, key)
        if taken is None or taken.request is None or taken.head is None:
            return
        asked = json.loads(taken.request)
        answer = None
        try:
            answer = dialect.resumed(asked["body"], who, taken.head)
            client, reply, ask = await self._asked(request, answer, asked["cache_salt"], asked["priority"])
        except MpserveError as exc:
            error = HttpError.from_mpserve(exc)
            event = answer.failed(error) if answer is not None else encode.event(error.body())
            self.journal.failed(who, key, event, taken.next_seq)
            return
        self._produce(dialect, answer, reply, client, ask, who, key, time.perf_counter(), taken, background=True)

    def _tail(self, answer: Answer, who: str, key: str, after: int) -> AsyncGenerator[bytes, None]:
        return self.journal.tail(who, key, after, lambda exc, _: answer.failed(HttpError.from_mpserve(exc)))
    async def _adapters(self, call: oai.Call, model: str) -> wire_adapters.Selection:
        """The adapters of llama-server's ``lora`` field, by name: its ids are the server's (``wire.adapters``)."""
        if not call.lora:
            return ()
        ids = [i["id"] for i in call.lora if isinstance(i, dict) and "id" in i]
        served = await self.backend.adapters(model, ids) if ids else {}
        return wire_adapters.from_lora(call.lora, served, model)

    async def _prepared(self, call: oai.Call, client: AsyncClient, model: str) -> oai.Call:
        """A chat's prompt from ``model``'s chat template; a completion echoing a token prompt, with its text."""
        if call.kind == "chat":
            return await call.with_chat_template(await self.backend.chat_template(model), self.renderer, model)
        if call.echo and isinstance(call.prompt, list):
            return call.with_echo_text(await client.detokenize(call.prompt,
                                                               model=wire_adapters.split_model(call.model)[0]))
        return call

    async def _events(self, dialect: Dialect, answer: Answer, reply: oai.Reply, stream: Stream,
                      chunks: AsyncIterator[str], text: str | None, started: float,
                      chosen: tuple[str, wire_adapters.Selection], fed: Pieces | None = None,
                      replay: Pieces | None = None) -> AsyncGenerator[bytes, None]:
        """The answer's events; those of chunks that arrived together leave together (one send). ``fed``: where
        each piece of text taken is appended (``Journal.produce``); ``replay``: the pieces an earlier producer of
        this stream took, whose events were sent: taken again for the answer's state, their events not sent."""
        ended = False
        ready = bytearray(b"".join(answer.opened(reply.model)))  # events not sent yet: more have arrived
        if replay:
            for index, piece in replay:
                for chunk in reply.chunks(piece, None, index):
                    answer.chunk(chunk)
            ready.clear()
        try:
            async for piece in _after(text, chunks):
                if fed is not None:
                    fed.append((stream.chunk_index, piece))
                for chunk in reply.chunks(piece, stream.chunk_logprobs, stream.chunk_index):
                    ready += b"".join(answer.chunk(chunk))
                if not stream.arrived:
                    yield bytes(ready)
                    ready.clear()
            self._done(dialect.path, chosen, stream.results, started)
            ended = True
            yield bytes(ready + b"".join(answer.closed(reply.last(stream.results, stream.done_logprobs),
                                                       stream.results)))
        except MpserveError as exc:
            ended = True
            self.metrics.outcome(dialect.path, exc.code)
            yield bytes(ready + answer.failed(HttpError.from_mpserve(exc)))
        finally:
            if not ended:
                self.metrics.outcome(dialect.path, ErrorCode.CANCELLED)
            await chunks.aclose()  # type: ignore[attr-defined]  # an async generator: cancels the request

    def _done(self, endpoint: str, chosen: tuple[str, wire_adapters.Selection], results: list[Result],
              started: float) -> None:
        """Count a completed request under its model and each of its LoRA adapters."""
        self.metrics.outcome(endpoint, "ok")
        model, adapters = chosen
        self.metrics.done(model, replace(results[0], usage=oai.total_usage(results)), time.perf_counter() - started,
                          tuple(name for name, _ in adapters))

    def _failed(self, dialect: Dialect, exc: MpserveError) -> JSONResponse:
        self.metrics.outcome(dialect.path, exc.code)
        return self._error(dialect, HttpError.from_mpserve(exc))

    @staticmethod
    def _error(dialect: Dialect, error: HttpError) -> JSONResponse:
        return JSONResponse(dialect.error_body(error), error.status, headers=error.headers())


@dataclass(frozen=True)
class Ask:
    """How a request is asked of the broker: its id there (under its tenant's tag), its cache_salt, its tenant,
    its LoRA adapters, its priority."""

    request_id: str
    cache_salt: str | None
    tenant: str
    adapters: wire_adapters.Selection
    counted: tuple[str, wire_adapters.Selection]  # the model and adapters its figures count under
    priority: int


@dataclass(frozen=True)
class Background:
    """What a dialect's answer that runs in the background (a Responses ``background: true``) gives the
    pipeline: its key in the journal, and what it is while it runs (JSON)."""

    key: str
    head: bytes


def _digest(body: Any) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _delivered(pieces: Pieces) -> dict[int, str]:
    """Each choice's text, from the pieces the dialect took."""
    delivered: dict[int, str] = {}
    for index, piece in pieces:
        delivered[index] = delivered.get(index, "") + piece
    return delivered


async def _after(first: str | None, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """``first`` (unless None), then ``chunks``."""
    if first is not None:
        yield first
    async for text in chunks:
        yield text
