"""Clients: ``AsyncClient`` (asyncio) and ``Client`` (sync, a thin facade over the async one).

One DEALER connection carries any number of concurrent requests. The event loop watches the socket's
descriptor; its callback takes every waiting message and sorts them by request id, and sends go out at
once from the coroutine that makes them (the callback sends those that met the high-water mark):

    generate/stream/... ──send now (NOBLOCK) or queue until POLLOUT──▶ DEALER ──▶ broker
    event loop: descriptor readable ──▶ _on_events: recv while POLLIN ──▶ the request's queue
    (ZeroMQ signals its descriptor on edges, so every send is followed by the same check)

Liveness follows the Paranoid Pirate pattern, both ways: while requests are pending the client pings
every ``PING_INTERVAL_S`` (so the broker can tell a waiting client from a vanished one, whose requests it
cancels), any message from the server counts as its heartbeat, and after ``PING_INTERVAL_S ×
PING_LIVENESS`` of silence the server is taken as gone. Its completions then reattach (``reattach`` seconds,
``REATTACH_S`` by default; 0: they fail at once), unless a local server was stopped (``runtime.stopped_here``: its
socket and secret files are gone, where a server that died leaves the secret file): the client connects afresh and
sends each again with ``reattach`` set, again after each silence, until a server answers or the time is up (then
``ConnectionFailed``).
A server that adopted the instance holding the request (``mpserve.server.adoption``) goes on with it and streams
its whole text so far first; any other runs it anew. The client drops the text it delivered already, checking it
is the same (a sampled request without a seed that ran anew differs: ``ConnectionFailed``), so no text repeats:

    chunk ─▶ Track.fresh (``mpserve.client_track``): the part past what this choice delivered ─▶ the request's queue
    silence ─▶ _reattach: new socket, each completion sent again, every choice's text to be seen again
    PONG of another start ─▶ _restarted: each completion it may lack sent again (one sent to the start before, or
                             sent on a new connection and not answered since: another listener may have taken it)

Tokenize, embed, stats and the operators' calls fail at the first silence, as before.
A server that is not running is reported at connect time. A request too large for the server (its
prompt over ``MAX_PROMPT_CHARS``, or its message over the limit the server tells in PONG, which its socket
would drop in silence) raises BadRequest before it is sent.

For a server bound to the network with CURVE, pass ``curve_server_key`` (the server's public key file)
and ``curve_secret`` (this client's secret key file, whose public half the server allows); both are made
by ``mpserve keygen``.

    async with AsyncClient() as client:
        result = await client.generate("Once upon a time", max_tokens=32, temperature=0)
        async for text in client.stream("Hello", max_tokens=16):
            print(text, end="")

Request ids: each client draws a random 64-bit prefix when it is made and numbers its messages after it
(``3f9c2a7be01d4c55.1``, ``.2``, ...), so an id names one request across clients, processes and hosts in the
slot table, the console and the logs. ``request_id=`` gives a request an id of the caller's own instead (a
tracing id: letters, digits and ``._:@/+=-``, at most ``wire.MAX_ID_CHARS``, of which the slot table keeps
``REQUEST_ID_CHARS``: what the gateway takes from its callers, before it puts their tenant's tag in front); an
id still pending on this client is refused.

Reuse: ``cache_salt=`` names the namespace a request's prompt may reuse cached prefixes in (vLLM's field,
``mpserve.wire.salt``): the requests naming one share, whoever sends them; without it a request reuses what
its tenant computed. ``tenant=`` is the gateway's, for the tenant of its caller's key.

Structured output: ``json_schema=`` (a dict, or its JSON text) or ``grammar=`` (GBNF text) constrains the
completion (``mpserve.structured`` lists the supported JSON-Schema keywords).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.auth

from mpserve import structured, tracing
from mpserve.client_track import Track
from mpserve.errors import BadRequest, ConfigError, ConnectionFailed, MpserveError, Timeout, error_from_code
from mpserve.runtime import default_address, listening, stopped_here
from mpserve.waits import within
from mpserve.wire import adapters as wire_adapters
from mpserve.wire import protocol as wire
from mpserve.wire import zmqio
from mpserve.wire.media import WithImages

T = TypeVar("T")
Adapters = Mapping[str, float] | Sequence[str | tuple[str, float]] | None  # LoRA adapters: {name: scale}, or names
Prompt = str | list[int] | WithImages  # text, token ids, or text with the images its media markers place

PING_INTERVAL_S = 1.0
PING_LIVENESS = 3
QUIET_PING_S = 0.25  # ... and pings this often once it has heard nothing that long: a restarted server answers soon
CONNECT_TIMEOUT_S = 5.0
REATTACH_S = 30.0  # how long completions wait for a server to come back after it went silent
SLOT_TIMEOUT_S = 60.0  # a KV file is written or read between two steps of its instance
REQUEST_ID_CHARS = 40  # an HTTP caller's request id: what the slot table keeps of one (the wire takes MAX_ID_CHARS)
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]+")


def request_ids() -> Iterator[str]:
    """Request ids no other source makes: a random 64-bit prefix, drawn once, and a counter (hex)."""
    prefix = secrets.token_hex(8)
    return (f"{prefix}.{n:x}" for n in itertools.count(1))


def check_request_id(value: str, limit: int = REQUEST_ID_CHARS) -> str:
    """A caller's request id of at most ``limit`` characters, or BadRequest saying what an id may hold."""
    if len(value) > limit or not _REQUEST_ID.fullmatch(value):
        raise BadRequest(f"a request id is 1 to {limit} letters, digits and ._:@/+=- characters, "
                         f"got {value[:limit + 8]!r}")
    return value


@dataclass(frozen=True)
class Result:
    id: str
    text: str
    finish_reason: str
    usage: wire.Usage
    timings: wire.Timings
    worker: str
    logprobs: wire.Logprobs | None = None  # asked for with logprobs=N: entries() per generated token
    index: int = 0  # which choice, of a request for n (``choices``)

    @classmethod
    def from_done(cls, done: wire.Done, streamed: list[wire.Logprobs] | None = None) -> Result:
        """``streamed``: the log-probabilities the request's chunks carried, before those of ``done``."""
        parts = [*(streamed or []), *([done.logprobs] if done.logprobs is not None else [])]
        return cls(done.id, done.text, done.finish_reason, done.usage, done.timings, done.worker,
                   wire.Logprobs.join(parts), done.index)


@dataclass(frozen=True)
class Embedded:
    vectors: list[list[float]]  # one per input, in order, L2-normalised
    prompt_tokens: int


@dataclass(frozen=True)
class Reranked:
    scores: list[float]  # one per document, in order: higher is more relevant
    prompt_tokens: int


@dataclass(frozen=True)
class Tokenized:
    tokens: list[int]
    pieces: list[bytes]  # each token's bytes, when asked for with_pieces; else empty


class Stream:
    """Async iterator of text chunks; ``result`` holds the final Result once iteration has ended, and
    ``chunk_logprobs`` the log-probabilities of the chunk just yielded (when asked for). With ``n`` choices,
    ``chunk_index`` says whose chunk it was, ``results`` holds every choice's Result (``result`` the first's)
    and ``done_logprobs`` each DONE's log-probabilities (of the tokens no chunk carried), by choice.
    ``arrived`` says whether the next step has its message already (so it will not wait)."""

    def __init__(self, client: AsyncClient, request: wire.Request, delivered: Mapping[int, str] | None = None
                 ) -> None:
        self._client = client
        self._request = request
        self._delivered = delivered
        self.id = request.id
        self.result: Result | None = None
        self.chunk_logprobs: wire.Logprobs | None = None
        self.chunk_index = 0
        self.results: list[Result] = []
        self.done_logprobs: dict[int, wire.Logprobs | None] = {}
        self._done: dict[int, Result] = {}
        self._choice_logprobs: dict[int, list[wire.Logprobs]] = {}
        self._queue: asyncio.Queue[Any] | None = None

    def __aiter__(self) -> AsyncGenerator[str, None]:
        return self._chunks()

    @property
    def arrived(self) -> bool:
        return self._queue is not None and not self._queue.empty()

    async def _chunks(self) -> AsyncGenerator[str, None]:
        queue = self._queue = await self._client._submit(self._request, self._delivered)
        try:
            while True:
                msg = await self._client._next(queue, self._request)
                if isinstance(msg, wire.Chunk):
                    self.chunk_logprobs, self.chunk_index = msg.logprobs, msg.index
                    if msg.logprobs is not None:
                        self._choice_logprobs.setdefault(msg.index, []).append(msg.logprobs)
                    yield msg.text
                else:
                    self.chunk_logprobs = self.done_logprobs[msg.index] = msg.logprobs
                    self._done[msg.index] = Result.from_done(msg, self._choice_logprobs.get(msg.index))
                    if len(self._done) == self._request.params.n:
                        self._client._pending.pop(self.id, None)
                        self.results = [self._done[i] for i in sorted(self._done)]
                        self.result = self.results[0]
                        return
        finally:
            if self.result is None:
                await self._client._abandon(self._request.id)


class AsyncClient:
    def __init__(self, address: str | None = None, *, server_name: str = "default",
                 timeout: float | None = None, connect_timeout: float = CONNECT_TIMEOUT_S,
                 curve_server_key: str | None = None, curve_secret: str | None = None,
                 reattach: float = REATTACH_S) -> None:
        """``reattach``: seconds the completions in flight wait for a silent server to come back (the same one
        restarted, adopting the instances that ran them: ``mpserve.server.adoption``); 0: a silence fails them."""
        self.address = address or default_address(server_name)
        self.timeout = timeout
        self.reattach = reattach
        self._tracks: dict[str, Track] = {}  # the completions sent, by id (those still pending are reattached)
        self._silent_since: float | None = None  # the server went silent then, and has not answered since
        self._server = ""  # the start of the server answering (its PONGs say), "" until one did
        self._connect_timeout = connect_timeout
        self._curve = _curve_keys(curve_server_key, curve_secret)
        self._ctx: zmq.Context[Any] | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the one that watches the socket's descriptor
        self._unsent: deque[tuple[list[bytes], asyncio.Future[None]]] = deque()  # waiting for room (SNDHWM)
        self._pending: dict[str, asyncio.Queue[Any]] = {}
        self._ids = request_ids()
        self._tasks: list[asyncio.Task[None]] = []  # the keep-alive
        self._last_heard = 0.0
        self._pong = asyncio.Event()
        self._nonces = itertools.count(1)
        self._stats_waiters: dict[int, asyncio.Future[wire.Stats]] = {}
        self.models: tuple[str, ...] = ()
        self.max_message_bytes = wire.MAX_MESSAGE_BYTES  # until the server's PONG tells its own

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        if self._sock is not None:
            return
        if self.address.startswith("ipc://") and not listening(self.address[len("ipc://"):]):
            raise ConnectionFailed(f"no server is listening at {self.address}; start one with `mpserve start`")
        self._ctx = zmq.Context.instance()  # never terminated: a term can hang on a socket whose CURVE
        # handshake failed (libzmq #2733, pyzmq #626), and the sockets close with LINGER 0
        self._open()
        self._tasks = [asyncio.get_running_loop().create_task(self._keep_alive())]
        # not waited for: a server that refuses this client's CURVE keys drops the connection, and the socket has
        # no room from then on (a ping sent after that waits for good); the answer's wait is the bound
        sent = self._put(wire.encode(wire.Ping(0)))
        try:
            await within(self._pong.wait(), self._connect_timeout)
        except asyncio.TimeoutError:
            if sent is not None:
                sent.cancel()
            await self.close()
            hint = " and does it accept your CURVE keys?" if self.address.startswith("tcp://") else "?"
            raise ConnectionFailed(f"no answer from a server at {self.address} within "
                                   f"{self._connect_timeout:g} s; is `mpserve start` running{hint}") from None

    def _open(self) -> None:
        """The DEALER socket, connected (ZeroMQ connects in the background: to an address nobody listens on yet
        too), its descriptor watched by the running loop."""
        assert self._ctx is not None
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 4 * wire.MAX_MESSAGE_BYTES + 4096)
        if self._curve is not None:
            server_public, public, secret = self._curve
            self._sock.curve_serverkey, self._sock.curve_publickey, self._sock.curve_secretkey = (
                server_public, public, secret)
        self._sock.connect(self.address)
        self._last_heard = time.monotonic()
        loop = asyncio.get_running_loop()
        self._loop = loop
        loop.add_reader(self._sock.fileno(), self._on_events)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        closed = ConnectionFailed("the client was closed")
        self._fail_all(closed)
        for _, sent in self._unsent:
            if not sent.done():
                sent.set_exception(closed)
        self._unsent.clear()
        if self._sock is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._sock.fileno())
                self._loop = None
            self._sock.close()
            self._sock = None
        self._ctx = None

    async def generate(self, prompt: Prompt, *, model: str | None = None, timeout: float | None = None,
                       request_id: str | None = None, adapters: Adapters = None, **params: Any) -> Result:
        """Run one completion and return its Result; raises the MpserveError of an ERROR reply. ``prompt``:
        text, or token ids (taken as they are: no BOS is added), or ``WithImages(text, images)``: images (PNG,
        JPEG, GIF, BMP) and audio clips (WAV, MP3), each where the text's next ``MEDIA_MARKER`` is, for a model
        served with a projector (``mpserve.wire.media``, ``mpserve.wire.audio``). ``request_id``: its id.
        ``priority`` (-100..100, higher starts first, capped by the tenant's ``max_priority``), ``cache_salt``
        (requests with one salt may share cached prompts) and ``tenant`` (on the admin socket only: whose the
        request is) go with the request; ``adapters``: the model's LoRA adapters to apply, ``{name: scale}`` or a
        list of names (scale 1); a ``model`` of ``BASE:NAME`` applies NAME too (``mpserve.wire.adapters``); the
        other keywords are sampling parameters."""
        if params.get("n", 1) != 1:
            raise BadRequest("generate returns one choice; ask for n with choices(prompt, n=...)")
        return (await self.choices(prompt, n=1, model=model, timeout=timeout, request_id=request_id,
                                   adapters=adapters, **params))[0]

    async def choices(self, prompt: Prompt, *, n: int | None = None, model: str | None = None,
                      timeout: float | None = None, request_id: str | None = None,
                      params: wire.GenerateParams | None = None, priority: int = 0, cache_salt: str | None = None,
                      tenant: str = "", adapters: Adapters = None, **sampling: Any) -> list[Result]:
        """``n`` choices of one completion, in index order: run together in ``n`` slots of one instance, which
        computes the prompt once; choice i is seeded with ``seed + i`` (modulo 2**32) when ``seed`` is given.
        A request for more choices than an instance has slots (``parallel``) is refused. The parameters are
        ``sampling``'s keywords and ``n``, or ``params`` as they are (with their ``n``)."""
        request = self._request(prompt, model, timeout, _params(params, sampling, n), stream=False,
                                request_id=request_id, owner=_Owner(priority, cache_salt, tenant), adapters=adapters)
        n = request.params.n
        queue = await self._submit(request)
        done: dict[int, Result] = {}
        try:
            while len(done) < n:
                msg = await self._next(queue, request)
                done[msg.index] = Result.from_done(msg)
        except BaseException:
            await self._abandon(request.id)
            raise
        self._pending.pop(request.id, None)
        return [done[i] for i in sorted(done)]

    def stream(self, prompt: Prompt, *, model: str | None = None, timeout: float | None = None,
               request_id: str | None = None, params: wire.GenerateParams | None = None, priority: int = 0,
               cache_salt: str | None = None, tenant: str = "", adapters: Adapters = None,
               delivered: Mapping[int, str] | None = None, **sampling: Any) -> Stream:
        """Stream a completion: ``async for text in client.stream(...)``; ``stream.id`` is its request id. The
        parameters are ``sampling``'s keywords, or ``params`` as they are; ``priority``, ``cache_salt`` and
        ``tenant`` as for ``generate``. ``delivered``: the text each choice of this request delivered already
        through another client that died (a gateway process's stream taken over by another): the request is sent
        marked ``reattach``, and that text, as it comes again, is dropped (checked equal: ConnectionFailed if
        not)."""
        request = self._request(prompt, model, timeout, _params(params, sampling), stream=True,
                                request_id=request_id, owner=_Owner(priority, cache_salt, tenant), adapters=adapters)
        if delivered is not None:
            request = msgspec.structs.replace(request, reattach=True)
        return Stream(self, request, delivered)

    async def cancel(self, request_id: str) -> None:
        await self._send(wire.Cancel(request_id))

    async def tokenize(self, text: str, *, model: str | None = None, add_special: bool = False,
                       with_pieces: bool = False, timeout: float | None = None) -> Tokenized:
        """``text`` in the tokens of ``model`` (``add_special``: with its BOS), by one of its instances."""
        answer = await self._lookup(wire.Tokenize(next(self._ids), model, text, add_special=add_special,
                                                  with_pieces=with_pieces, timeout=timeout or self.timeout))
        ends = wire.unpack_tokens(answer.piece_ends)
        return Tokenized(wire.unpack_tokens(answer.tokens),
                         [answer.pieces[start:end] for start, end in zip([0, *ends], ends, strict=False)])

    async def detokenize(self, tokens: list[int], *, model: str | None = None, timeout: float | None = None) -> str:
        """The text of ``tokens`` in the vocabulary of ``model``."""
        answer = await self._lookup(wire.Tokenize(next(self._ids), model, tokens=wire.pack_tokens(tokens),
                                                  detokenize=True, timeout=timeout or self.timeout))
        return answer.text

    async def embed(self, inputs: str | list[str] | list[int] | list[list[int]], *, model: str | None = None,
                    timeout: float | None = None, request_id: str | None = None) -> Embedded:
        """The embeddings of ``inputs`` (a text, texts, token ids, or lists of token ids) by an embedding model
        (``embedding: true``), all computed by one of its instances, as many in one decode as fit."""
        items: list[Any] = [inputs] if isinstance(inputs, str) or (inputs and all(
            isinstance(i, int) for i in inputs)) else list(inputs)  # one text, or one token array
        texts = tuple(i for i in items if isinstance(i, str))
        arrays = tuple(wire.pack_tokens(i) for i in items if isinstance(i, list))
        if len(texts) + len(arrays) != len(items) or (texts and arrays):
            raise BadRequest("'input' must be a text, a list of texts, a list of token ids or a list of those lists")
        rid = next(self._ids) if request_id is None else check_request_id(request_id, wire.MAX_ID_CHARS)
        msg = wire.Embed(rid, model, texts, arrays, timeout=timeout or self.timeout)
        answer = await self._ask(msg, None if msg.timeout is None else msg.timeout + 1.0,
                                 Timeout(f"no answer within {msg.timeout} s"))
        assert isinstance(answer, wire.Embeddings)
        return Embedded(answer.rows(), answer.prompt_tokens)

    async def rerank(self, query: str, documents: list[str], *, model: str | None = None,
                     timeout: float | None = None, request_id: str | None = None) -> Reranked:
        """Each document's relevance to ``query`` by a reranker (``embedding: true, pooling: rank``), in the
        documents' order, all computed by one of its instances."""
        if not documents or not all(isinstance(d, str) and d for d in documents):
            raise BadRequest("'documents' must be a non-empty list of non-empty texts")
        rid = next(self._ids) if request_id is None else check_request_id(request_id, wire.MAX_ID_CHARS)
        msg = wire.Embed(rid, model, tuple(documents), timeout=timeout or self.timeout, query=query)
        answer = await self._ask(msg, None if msg.timeout is None else msg.timeout + 1.0,
                                 Timeout(f"no answer within {msg.timeout} s"))
        assert isinstance(answer, wire.Embeddings)
        return Reranked([row[0] for row in answer.rows()], answer.prompt_tokens)

    async def stats(self, timeout: float = CONNECT_TIMEOUT_S) -> wire.Stats:
        """The broker's counters and per-model queue state."""
        await self.connect()
        nonce = next(self._nonces)
        waiter: asyncio.Future[wire.Stats] = asyncio.get_running_loop().create_future()
        self._stats_waiters[nonce] = waiter
        try:
            await self._send(wire.StatsQuery(nonce))
            return await within(waiter, timeout)
        except asyncio.TimeoutError:
            raise ConnectionFailed(f"no answer from the server at {self.address} within {timeout:g} s") from None
        finally:
            self._stats_waiters.pop(nonce, None)

    async def control(self, op: str, model: str | None = None, *, min: int | None = None, max: int | None = None,
                      path: str | None = None, timeout: float = CONNECT_TIMEOUT_S) -> wire.ControlReply:
        """An operator's call (``models``, ``load``, ``unload``, ``scale``, ``add``); a refused one raises its
        error. ``path`` (add) is read by the server, relative to its own folder."""
        call = wire.Control(next(self._ids), op, model, min, max, path)
        call.validate()
        answer = await self._ask(call, timeout, ConnectionFailed(
            f"no answer from the server at {self.address} within {timeout:g} s"))
        assert isinstance(answer, wire.ControlReply)
        return answer

    async def slot(self, action: str, worker: str, slot: int, filename: str = "",
                   timeout: float = SLOT_TIMEOUT_S) -> wire.SlotReply:
        """``save`` slot ``slot`` of instance ``worker`` (w0, w1, ... as ``mpserve status`` shows) to ``filename`` in
        its model's slot_save_path, ``restore`` it from there, or ``erase`` it; a refused one raises its error."""
        msg = wire.SlotAction(next(self._ids), worker, slot, action, filename)
        msg.validate()
        answer = await self._ask(msg, timeout, ConnectionFailed(
            f"no answer from the server at {self.address} within {timeout:g} s"))
        assert isinstance(answer, wire.SlotReply)
        return answer

    async def adapter(self, op: str, model: str | None, name: str, path: str = "",
                      timeout: float = SLOT_TIMEOUT_S) -> wire.AdapterReply:
        """An operator's call on the admin socket: ``load`` LoRA adapter ``name`` of ``model`` from ``path`` (a GGUF
        on the server's host) into every instance, or ``unload`` it once the requests using it have finished; a
        refused one raises its error."""
        msg = wire.AdapterAction(next(self._ids), op, name, model, path)
        msg.validate()
        answer = await self._ask(msg, timeout, ConnectionFailed(
            f"no answer from the server at {self.address} within {timeout:g} s"))
        assert isinstance(answer, wire.AdapterReply)
        return answer

    # --- internals ------------------------------------------------------------------------------

    def _request(self, prompt: Prompt, model: str | None, timeout: float | None,
                 generate: wire.GenerateParams, stream: bool, request_id: str | None = None,
                 owner: _Owner | None = None, adapters: Adapters = None) -> wire.Request:
        images = prompt.images if isinstance(prompt, WithImages) else ()
        prompt = prompt.text if isinstance(prompt, WithImages) else prompt
        if isinstance(prompt, str) and len(prompt) > wire.MAX_PROMPT_CHARS:
            raise BadRequest(f"the prompt is {len(prompt)} characters; the server takes at most "
                             f"{wire.MAX_PROMPT_CHARS} (MAX_PROMPT_CHARS)")
        text, tokens = (prompt, b"") if isinstance(prompt, str) else ("", wire.pack_tokens(prompt))
        rid = next(self._ids) if request_id is None else check_request_id(request_id, wire.MAX_ID_CHARS)
        owner = owner or _Owner()
        model, chosen = wire_adapters.selection(model, adapters)
        request = wire.Request(rid, text, model, generate, stream, timeout if timeout is not None else self.timeout,
                               tokens, adapters=chosen, priority=owner.priority, cache_salt=owner.cache_salt,
                               tenant=owner.tenant, traceparent=tracing.outgoing(), images=images)
        if owner != _Owner() or images:
            request.validate()  # its bounds, as the broker would refuse them
        return request

    async def _lookup(self, msg: wire.Tokenize) -> wire.Tokens:
        """Send a TOKENIZE and wait for its TOKENS; raises the MpserveError of an ERROR reply."""
        answer = await self._ask(msg, None if msg.timeout is None else msg.timeout + 1.0,
                                 Timeout(f"no answer within {msg.timeout} s"))
        assert isinstance(answer, wire.Tokens)
        return answer

    async def _ask(self, msg: wire.Tokenize | wire.Control | wire.Embed | wire.SlotAction | wire.AdapterAction,
                   wait: float | None, timed_out: MpserveError) -> Any:
        """Send a message that has one answer and wait for it (``wait`` seconds; None: no limit); raises the
        MpserveError of an ERROR reply, or ``timed_out``."""
        await self.connect()
        queue = self._claim(msg.id)
        try:
            await self._send(msg)
            answer = await within(queue.get(), wait)
        except asyncio.TimeoutError:
            raise timed_out from None
        finally:
            self._pending.pop(msg.id, None)
        if isinstance(answer, MpserveError):
            raise answer
        return answer

    async def _submit(self, request: wire.Request, delivered: Mapping[int, str] | None = None
                      ) -> asyncio.Queue[Any]:
        await self.connect()
        frames = wire.encode(request)
        if len(frames[2]) > self.max_message_bytes:
            raise BadRequest(f"the request is {len(frames[2])} bytes encoded; the server takes messages of at "
                             f"most {self.max_message_bytes} bytes (MAX_MESSAGE_BYTES)")
        queue = self._claim(request.id)
        if len(self._tracks) > 2 * len(self._pending) + 16:  # those answered, dropped now and then
            self._tracks = {rid: t for rid, t in self._tracks.items() if rid in self._pending}
        track = self._tracks[request.id] = Track(request, self._server)
        if delivered is not None:
            track.resumed(delivered)
        await self._write(frames)
        return queue

    def _claim(self, request_id: str) -> asyncio.Queue[Any]:
        """The queue of a new request's answers, under its id; an id still pending is refused."""
        if request_id in self._pending:
            raise BadRequest(f"request id {request_id!r} is already in use by a pending request of this client")
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._pending[request_id] = queue
        return queue

    async def _next(self, queue: asyncio.Queue[Any], request: wire.Request) -> Any:
        """The next CHUNK or DONE of a request; raises on ERROR, on silence, or past its timeout."""
        if queue.empty():
            limit = None if request.timeout is None else request.timeout + 1.0
            try:
                msg = await within(queue.get(), limit)
            except asyncio.TimeoutError:
                raise Timeout(f"no answer within {request.timeout} s") from None
        else:
            msg = queue.get_nowait()
        if isinstance(msg, MpserveError):
            self._pending.pop(request.id, None)
            raise msg
        return msg

    async def _abandon(self, request_id: str) -> None:
        """Cancel a request that the caller stopped waiting for."""
        if self._pending.pop(request_id, None) is not None and self._sock is not None:
            await self._send(wire.Cancel(request_id))

    async def _send(self, msg: Any) -> None:
        await self._write(wire.encode(msg))

    async def _write(self, frames: list[bytes]) -> None:
        """Send at once if the socket has room (its high-water mark not reached), else when it has (in
        order, after those already waiting); then take what the send made readable."""
        sent = self._put(frames)
        if sent is not None:
            await sent

    def _put(self, frames: list[bytes]) -> asyncio.Future[None] | None:
        """``_write`` without the wait: None if sent at once, else the future set once it is. The keep-alive
        sends so: a socket that never gets room (a server that refuses this client's CURVE key holds no
        connection to it) must not stop it from counting the silence to its bound."""
        sock = self._sock
        if sock is None:
            raise ConnectionFailed("the client was closed")
        if not self._unsent:
            try:
                zmqio.send(sock, frames, zmqio.NOBLOCK)
            except zmq.Again:
                pass
            else:
                self._on_events()
                return None
        sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._unsent.append((frames, sent))
        self._on_events()
        return sent

    def _on_events(self) -> None:
        """The socket's descriptor is readable, or a send may have changed what the socket holds: deliver every
        waiting message, and send what waits for room, until neither is possible."""
        sock = self._sock
        heard = False
        while sock is not None:
            events = zmqio.events(sock)
            if events & zmqio.POLLIN:
                self._deliver(zmqio.recv(sock, zmqio.NOBLOCK))
                heard = True
            elif self._unsent and events & zmqio.POLLOUT:
                frames, sent = self._unsent.popleft()
                if not sent.done():  # one whose sender gave up is not sent
                    zmqio.send(sock, frames, zmqio.NOBLOCK)
                    sent.set_result(None)
            else:
                break
            sock = self._sock  # a delivery may have closed the client
        if heard:
            self._last_heard = time.monotonic()

    async def _keep_alive(self) -> None:
        """While requests are pending: ping every PING_INTERVAL_S (QUIET_PING_S while the server is silent), and
        fail them all once the server has been silent for PING_INTERVAL_S × PING_LIVENESS (any message counts)."""
        pinged = reattached = 0.0
        while True:
            await asyncio.sleep(QUIET_PING_S)
            now = time.monotonic()
            if not self._pending:
                self._last_heard, self._silent_since = now, None
            elif now - self._last_heard > PING_INTERVAL_S * PING_LIVENESS and now - reattached >= PING_INTERVAL_S / 2:
                first, reattached = self._silent_since is None, now
                since = self._silent_since = self._silent_since or self._last_heard
                failed = ConnectionFailed(f"the server at {self.address} stopped answering ({now - since:.1f} s of "
                                          "silence)")
                completions = [rid for rid in self._pending if rid in self._tracks]
                if not completions or now - since > self.reattach or first and stopped_here(self.address):
                    self._fail_all(failed)
                else:
                    for rid in [rid for rid in self._pending if rid not in self._tracks]:
                        self._pending.pop(rid).put_nowait(failed)
                    await self._reattach(completions)
            elif now - pinged >= (PING_INTERVAL_S if now - self._last_heard < QUIET_PING_S else QUIET_PING_S):
                pinged = now
                self._put(wire.encode(wire.Ping(1)))

    def _restarted(self, server: str) -> None:
        """The server answering is another start than the one the pending completions were sent to (ZeroMQ
        reconnected to it before any silence showed): they are sent to it again, marked ``reattach``. So is one sent
        on a new connection and not answered yet: the connection may have met another listener first, which dropped
        it (a server that died as it started); a start that has it already ignores the copy (``Clients.admit``)."""
        first, self._server = not self._server, server
        again = []
        for rid in [rid for rid in self._pending if rid in self._tracks]:
            track = self._tracks[rid]
            if track.server is None:  # sent again on a new connection, to whichever start took it
                track.server = server
                if not track.heard:
                    again.append(rid)
            elif track.server != server:
                again.append(rid)
        if not first and again and self.reattach and self._loop is not None:
            self._tasks.append(self._loop.create_task(self._reattach(again, reconnect=False)))

    async def _reattach(self, completions: list[str], reconnect: bool = True) -> None:
        """Connect afresh (``reconnect``) and send each completion again, marked ``reattach``; the text each choice
        delivered is to be seen again before anything new (``Track``)."""
        if reconnect and self._sock is not None and self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._open()  # what waits for room (``_unsent``) goes out on the new socket
        for rid in completions:
            track = self._tracks.get(rid)
            if track is None or rid not in self._pending:
                continue
            track.reattached()
            track.server = None if reconnect else self._server
            self._put(wire.encode(msgspec.structs.replace(track.request, reattach=True)))

    def _deliver(self, frames: list[bytes]) -> None:
        try:
            msg = wire.decode(frames)
        except MpserveError:
            return  # a server speaking another protocol; the request will time out or fail liveness
        self._silent_since = None
        if isinstance(msg, wire.Pong):
            self.models = msg.models
            self.max_message_bytes = msg.max_message_bytes or wire.MAX_MESSAGE_BYTES
            self._pong.set()
            if msg.server and msg.server != self._server:
                self._restarted(msg.server)
            return
        if isinstance(msg, wire.Stats):
            waiter = self._stats_waiters.get(msg.nonce)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)
            return
        if isinstance(msg, wire.Error):
            target = self._pending.get(msg.id) if msg.id is not None else None
            err = error_from_code(msg.code, msg.message, msg.retry_after)
            if target is not None:
                target.put_nowait(err)
            return
        for one in msg.chunks if isinstance(msg, wire.Chunks) else (msg,):
            request_id = getattr(one, "id", None)
            if not isinstance(request_id, str) or request_id not in self._pending:
                continue
            queue = self._pending[request_id]
            tracked = self._tracks.get(request_id)
            if tracked is not None:
                tracked.heard = True
            track = tracked if isinstance(one, wire.Chunk) else None
            if track is not None:
                try:
                    text = track.fresh(one.index, one.text)
                except ConnectionFailed as exc:
                    del self._pending[one.id]
                    queue.put_nowait(exc)
                    continue
                if not text:
                    continue
                if text != one.text:  # its start came again: what is left of it (its log-probabilities are not)
                    one = msgspec.structs.replace(one, text=text, logprobs=None)
            queue.put_nowait(one)

    def _fail_all(self, err: MpserveError) -> None:
        for queue in self._pending.values():
            queue.put_nowait(err)
        self._pending.clear()


@dataclass(frozen=True)
class _Owner:
    """Whose a request is and how urgent: ``wire.Request``'s priority, cache_salt and tenant."""

    priority: int = 0
    cache_salt: str | None = None
    tenant: str = ""


def _params(params: wire.GenerateParams | None, sampling: dict[str, Any], n: int | None = None) -> wire.GenerateParams:
    """``params`` as they are (a GenerateParams is checked where it is made: ``GenerateParams.from_wire``, and
    by the broker), or the keyword arguments ``sampling`` (and ``n``) made into one and checked."""
    if params is not None:
        if sampling or n not in (None, params.n):
            raise BadRequest(f"give the parameters as params= or as keywords, not both (got params= and "
                             f"{', '.join(sorted(sampling)) or 'n'})")
        return params
    if n is not None:
        sampling = {**sampling, "n": n}
    if not isinstance(sampling.get("json_schema"), (str, type(None))):  # travels as its canonical JSON text
        sampling = {**sampling, "json_schema": structured.canonical_json(sampling["json_schema"])}
    generate = wire.GenerateParams(**{**sampling, "stop": tuple(sampling.get("stop", ())),
                                      "logit_bias": wire.logit_bias_pairs(sampling.get("logit_bias", ()))})
    generate.validate()
    return generate


def _curve_keys(server_key: str | None, secret: str | None) -> tuple[bytes, bytes, bytes] | None:
    if server_key is None and secret is None:
        return None
    if server_key is None or secret is None:
        raise ConfigError("CURVE needs both curve_server_key (the server's public .key file) and curve_secret "
                          "(this client's .key_secret file)")
    try:
        server_public, _ = zmq.auth.load_certificate(server_key)
        public, private = zmq.auth.load_certificate(secret)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read CURVE keys: {exc}") from None
    if private is None:
        raise ConfigError(f"{secret} holds no secret key; pass the .key_secret file made by `mpserve keygen`")
    return server_public, public, private


class Client:
    """Synchronous client. Thread-safe: any number of threads may use one Client at once."""

    def __init__(self, address: str | None = None, *, server_name: str = "default",
                 timeout: float | None = None, connect_timeout: float = CONNECT_TIMEOUT_S,
                 curve_server_key: str | None = None, curve_secret: str | None = None,
                 reattach: float = REATTACH_S) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mpserve-client", daemon=True)
        self._thread.start()
        self._async = AsyncClient(address, server_name=server_name, timeout=timeout,
                                  connect_timeout=connect_timeout, curve_server_key=curve_server_key,
                                  curve_secret=curve_secret, reattach=reattach)
        self.address = self._async.address
        try:
            self._call(self._async.connect())
        except BaseException:
            self._stop_loop()
            raise

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def models(self) -> tuple[str, ...]:
        return self._async.models

    @property
    def max_message_bytes(self) -> int:
        return self._async.max_message_bytes

    @property
    def open(self) -> bool:
        return self._loop.is_running()

    def generate(self, prompt: Prompt, *, model: str | None = None, timeout: float | None = None,
                 request_id: str | None = None, adapters: Adapters = None, **params: Any) -> Result:
        return self._call(self._async.generate(prompt, model=model, timeout=timeout, request_id=request_id,
                                               adapters=adapters, **params))

    def choices(self, prompt: Prompt, *, n: int, model: str | None = None, timeout: float | None = None,
                request_id: str | None = None, adapters: Adapters = None, **params: Any) -> list[Result]:
        return self._call(self._async.choices(prompt, n=n, model=model, timeout=timeout, request_id=request_id,
                                              adapters=adapters, **params))

    def stream(self, prompt: Prompt, *, model: str | None = None, timeout: float | None = None,
               request_id: str | None = None, adapters: Adapters = None, **params: Any) -> SyncStream:
        return SyncStream(self, self._async.stream(prompt, model=model, timeout=timeout, request_id=request_id,
                                                   adapters=adapters, **params))

    def cancel(self, request_id: str) -> None:
        self._call(self._async.cancel(request_id))

    def tokenize(self, text: str, *, model: str | None = None, add_special: bool = False,
                 with_pieces: bool = False, timeout: float | None = None) -> Tokenized:
        return self._call(self._async.tokenize(text, model=model, add_special=add_special, with_pieces=with_pieces,
                                               timeout=timeout))

    def detokenize(self, tokens: list[int], *, model: str | None = None, timeout: float | None = None) -> str:
        return self._call(self._async.detokenize(tokens, model=model, timeout=timeout))

    def embed(self, inputs: str | list[str] | list[int] | list[list[int]], *, model: str | None = None,
              timeout: float | None = None, request_id: str | None = None) -> Embedded:
        return self._call(self._async.embed(inputs, model=model, timeout=timeout, request_id=request_id))

    def rerank(self, query: str, documents: list[str], *, model: str | None = None,
               timeout: float | None = None, request_id: str | None = None) -> Reranked:
        return self._call(self._async.rerank(query, documents, model=model, timeout=timeout, request_id=request_id))

    def stats(self, timeout: float = CONNECT_TIMEOUT_S) -> wire.Stats:
        return self._call(self._async.stats(timeout))

    def control(self, op: str, model: str | None = None, *, min: int | None = None, max: int | None = None,
                path: str | None = None, timeout: float = CONNECT_TIMEOUT_S) -> wire.ControlReply:
        return self._call(self._async.control(op, model, min=min, max=max, path=path, timeout=timeout))

    def slot(self, action: str, worker: str, slot: int, filename: str = "",
             timeout: float = SLOT_TIMEOUT_S) -> wire.SlotReply:
        return self._call(self._async.slot(action, worker, slot, filename, timeout))

    def adapter(self, op: str, model: str | None, name: str, path: str = "",
                timeout: float = SLOT_TIMEOUT_S) -> wire.AdapterReply:
        return self._call(self._async.adapter(op, model, name, path, timeout))

    def close(self) -> None:
        if self.open:
            self._call(self._async.close())
            self._stop_loop()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        """Stop the loop thread, after every call still waiting on it has ended: they were failed with
        ConnectionFailed by close(); what has not ended after that is cancelled."""
        async def settle() -> None:
            await asyncio.sleep(0.01)
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        if self._loop.is_running():
            self._call(settle())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()


class SyncStream:
    """Iterator of text chunks; ``result`` holds the final Result once iteration has ended (``results``
    every choice's, ``chunk_index`` whose chunk was just yielded, as ``Stream``)."""

    def __init__(self, client: Client, stream: Stream) -> None:
        self._client = client
        self._stream = stream
        self.id = stream.id
        self._chunks = stream.__aiter__()

    @property
    def result(self) -> Result | None:
        return self._stream.result

    @property
    def results(self) -> list[Result]:
        return self._stream.results

    @property
    def chunk_index(self) -> int:
        return self._stream.chunk_index

    def __iter__(self) -> Iterator[str]:
        try:
            while True:
                try:
                    yield self._client._call(self._chunks.__anext__())
                except StopAsyncIteration:
                    return
        finally:  # left early: cancel the request (unless the client was closed, which ended it already)
            if self._stream.result is None and self._client.open:
                self._client._call(self._chunks.aclose())
