"""The wire: the only module that knows how messages are framed and encoded.

Every message is a ZeroMQ multipart message. ROUTER sockets see a routing-identity frame first; that
frame belongs to ZeroMQ and is not described here.

    client  -> broker   [VERSION, TYPE, BODY]            REQUEST, CANCEL, PING, STATS_QUERY, TOKENIZE, CONTROL,
                                                         EMBED, SLOT_ACTION
    broker  -> client   [VERSION, TYPE, BODY]            CHUNK, CHUNKS, DONE, ERROR, PONG, STATS, TOKENS,
                                                         CONTROL_REPLY, EMBEDDINGS, SLOT_REPLY
    broker  -> worker   [VERSION, TYPE, BODY]            ASSIGN, ASSIGNS, CANCEL, STOP, UNLOAD, TOKENIZE, EMBED,
                                                         SLOT_ACTION
    worker  -> broker   [VERSION, TYPE, TICKET, BODY]    READY, HEARTBEAT, FAILED, UNLOADED, LEAVING (empty TICKET);
                                                         CHUNK, DONE, ERROR (TICKET of an ASSIGN);
                                                         TOKENS, ERROR (TICKET of a TOKENIZE);
                                                         EMBEDDINGS, ERROR (TICKET of an EMBED);
                                                         SLOT_REPLY, ERROR (TICKET of a SLOT_ACTION)
                        [VERSION, CHUNK, TICKET, BODY, TOKENS]  when the ASSIGN asked for ``report_tokens``
                        [VERSION, DONE|ERROR, TICKET, BODY, CACHE]  when the prompt cache changed
                        [VERSION, READY, b"", BODY, CACHE]  when the worker's prompt cache holds entries
                        [VERSION, STEP, b"", BATCH]      the CHUNKs, DONEs and ERRORs of one step, in order

VERSION is ``b"MPS1"``. TYPE is one byte (``MsgType``). BODY is a msgpack map whose schema is the
frozen class of that type below (a msgspec Struct for REQUEST and ASSIGN, a dataclass for the rest).
TICKET is the broker's opaque key for one assignment: a worker echoes it so the broker can forward the BODY
of CHUNK/DONE/ERROR to the client unchanged (the worker writes the client's own request id into it), without
decoding and re-encoding every token. TOKENS is the ids of the tokens generated since the previous CHUNK,
int32 little-endian (``token_frame``): the broker appends them without decoding anything, and hands them to
the next instance if this one is lost (``Assign.generated``), which continues the request from there. CACHE
(``CacheChanges``, a msgpack map) says what the instance's host-RAM prompt cache gained and lost since its
previous CACHE frame; the broker reads it and forwards the BODY as it does without one.

Batches keep the message count from growing with the number of sequences a step or a turn handles (each
message costs a send, a wake-up and a receive in two processes):

- STEP (worker -> broker) carries what one worker step produced for several requests: its BATCH is a
  msgpack array of ``[TYPE, TICKET, BODY, TRAILER or nil]`` (TYPE: CHUNK, DONE or ERROR; TRAILER: the
  TOKENS or CACHE frame the message has on its own), in the order the worker made them.
- CHUNKS (broker -> client) carries the CHUNKs of one STEP meant for one client: its BODY is a msgpack
  array of those CHUNK bodies, spliced together unchanged (``splice_array``).
- ASSIGNS (broker -> worker) carries the ASSIGNs one turn of the broker made for one worker: a msgpack
  array of ASSIGN bodies.

A batch of one travels as the plain message (CHUNK, DONE, ERROR, ASSIGN).

Decoding never trusts the sender: bodies are unpacked with explicit size limits, every field is type-
and range-checked, and any problem raises ``ProtocolError`` (broken framing, unknown type, bad msgpack)
or ``BadRequest`` (a well-formed request with bad parameters), which the receiver answers or counts.

    REQUEST, ASSIGN(S) body ─▶ msgspec (types, in C) ─▶ check() (ranges, lengths, grammars) ─▶ the message
                                  │ refused
                                  ▼
    any other body ─────────▶ msgpack with limits ─▶ from_wire (types, then the same checks) ─▶ the message,
                                                                              or the error that names the problem
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar

import msgpack
import msgspec

from mpserve import structured
from mpserve.errors import BadRequest, ProtocolError
from mpserve.wire.prefix import MAX_BLOCKS

VERSION = b"MPS1"
WORKER_LINK = "MPS1.1"  # the revision of the broker-worker messages, in every READY: a broker refuses workers
# of another (1.1: STEP replaced the worker's CHUNKS, and ASSIGNS came), so a remote pool is upgraded with it
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_CACHE_ITEMS = 4096  # entries per list in a CACHE frame: the decoder's array limit
MAX_CACHE_HASHES = 1 << 14  # hashes a broker keeps per instance (and a READY's CACHE frame carries at most)
MAX_TEMPLATE_CHARS = 256 * 1024  # a GGUF chat template; the longest known ones are tens of kilobytes
MAX_PROMPT_CHARS = 1024 * 1024
MAX_ID_CHARS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TOKENS_LIMIT = 1 << 20
MAX_LOGIT_BIAS = 1024  # token ids one request may bias
MAX_TOP_LOGPROBS = 20  # most probable tokens reported per generated token (OpenAI's limit)
MAX_EMBED_INPUTS = 2048  # inputs of one EMBED (OpenAI's limit)
MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int32 (pack_tokens)
MAX_CHOICES = 128  # ``n``: choices one request may ask for (OpenAI's limit; an instance's parallel caps it too)


class MsgType(IntEnum):
    REQUEST = 0x01
    CANCEL = 0x02
    PING = 0x03
    STATS_QUERY = 0x04
    TOKENIZE = 0x05
    CONTROL = 0x06
    EMBED = 0x07
    SLOT_ACTION = 0x08
    CHUNK = 0x10
    DONE = 0x11
    ERROR = 0x12
    PONG = 0x13
    STATS = 0x14
    TOKENS = 0x15
    CONTROL_REPLY = 0x16
    EMBEDDINGS = 0x17
    CHUNKS = 0x18
    SLOT_REPLY = 0x19
    READY = 0x20
    HEARTBEAT = 0x21
    FAILED = 0x22
    UNLOADED = 0x23
    STEP = 0x24
    LEAVING = 0x25
    ASSIGN = 0x30
    STOP = 0x31
    UNLOAD = 0x32
    ASSIGNS = 0x33


TYPE_FRAMES: dict[MsgType, bytes] = {t: bytes([t]) for t in MsgType}


# --- field checks -------------------------------------------------------------------------------

def _get(body: dict[str, Any], key: str, kinds: type | tuple[type, ...], default: Any = ..., *,
         bad: type[Exception] = ProtocolError) -> Any:
    if key not in body:
        if default is ...:
            raise bad(f"missing field '{key}'")
        return default
    value = body[key]
    if value is None and default is None:
        return None
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise bad(f"field '{key}' must be {_kind_name(kinds)}, got a boolean")
    if not isinstance(value, kinds):
        raise bad(f"field '{key}' must be {_kind_name(kinds)}, got {type(value).__name__}")
    return value


def _kind_name(kinds: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", dict: "a map",
             list: "a list", tuple: "a list"}
    ks = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in ks))


def _ranged(key: str, value: float | int, lo: float, hi: float) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(f"'{key}' must be a finite number, got {value}")
    if not lo <= value <= hi:
        raise BadRequest(f"'{key}' must be between {lo} and {hi}, got {value}")


def _text(body: dict[str, Any], key: str, max_chars: int, default: Any = ...,
          bad: type[Exception] = ProtocolError) -> Any:
    value = _get(body, key, str, default, bad=bad)
    if value is not None:
        _limit(key, value, max_chars, bad)
    return value


def _limit(key: str, value: str, max_chars: int, bad: type[Exception]) -> None:
    if len(value) > max_chars:
        raise bad(f"field '{key}' is longer than {max_chars} characters")


# --- bodies -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template as it travels: read by the worker that loads the model (READY), kept by the
    broker per model (STATS), rendered by the gateway (``mpserve.gateway.api.chat``)."""

    template: str = ""  # Jinja2 source; "" when the model has none
    bos_token: str = ""
    eos_token: str = ""

    def __bool__(self) -> bool:
        return bool(self.template)


class GenerateParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Sampling parameters, as llama.cpp takes them. temperature 0 means greedy."""

    max_tokens: int = 128
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    seed: int | None = None
    stop: tuple[str, ...] = ()
    repeat_penalty: float = 1.0
    # OpenAI's and llama-server's sampling parameters, through llama.cpp's samplers (mpserve.engine.sampling)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), on the wire as pairs
    min_p: float = 0.05
    typical_p: float = 1.0
    ignore_eos: bool = False  # end-of-generation tokens are never sampled
    logprobs: int | None = None  # report each generated token's log-probability and the N most probable
    # structured output (mpserve.structured): GBNF text, or a JSON Schema as canonical JSON text; one at most
    grammar: str | None = None
    json_schema: str | None = None
    prompt_logprobs: bool = False  # with logprobs: the prompt's tokens' too, first (Logprobs.prompt)
    n: int = 1  # choices, in n slots of one instance, choice i seeded with seed + i (``choice_params``)
    # speculative decoding (models[].speculative): most tokens drafted a step for this request, at most the
    # model's n_max (0: none); None: the model's setting
    speculative_n_max: int | None = None

    @classmethod
    def from_wire(cls, body: Any) -> GenerateParams:
        if not isinstance(body, dict):
            raise BadRequest("'params' must be a map")
        unknown = body.keys() - _PARAM_NAMES
        if unknown:
            raise BadRequest(f"unknown parameter(s) {sorted(map(str, unknown))}; allowed: "
                             f"{list(cls.__struct_fields__)}")
        d = _DEFAULT_PARAMS
        num = (int, float)
        params = cls(
            max_tokens=_get(body, "max_tokens", int, d.max_tokens, bad=BadRequest),
            temperature=float(_get(body, "temperature", num, d.temperature, bad=BadRequest)),
            top_p=float(_get(body, "top_p", num, d.top_p, bad=BadRequest)),
            top_k=_get(body, "top_k", int, d.top_k, bad=BadRequest),
            seed=_get(body, "seed", int, None, bad=BadRequest),
            stop=tuple(_get(body, "stop", (list, tuple), (), bad=BadRequest)),
            repeat_penalty=float(_get(body, "repeat_penalty", num, d.repeat_penalty, bad=BadRequest)),
            presence_penalty=float(_get(body, "presence_penalty", num, d.presence_penalty, bad=BadRequest)),
            frequency_penalty=float(_get(body, "frequency_penalty", num, d.frequency_penalty, bad=BadRequest)),
            logit_bias=logit_bias_pairs(_get(body, "logit_bias", (dict, list, tuple), (), bad=BadRequest)),
            min_p=float(_get(body, "min_p", num, d.min_p, bad=BadRequest)),
            typical_p=float(_get(body, "typical_p", num, d.typical_p, bad=BadRequest)),
            ignore_eos=_get(body, "ignore_eos", bool, d.ignore_eos, bad=BadRequest),
            logprobs=_get(body, "logprobs", int, None, bad=BadRequest),
            grammar=_get(body, "grammar", str, None, bad=BadRequest),
            json_schema=_get(body, "json_schema", str, None, bad=BadRequest),
            prompt_logprobs=_get(body, "prompt_logprobs", bool, False, bad=BadRequest),
            n=_get(body, "n", int, 1, bad=BadRequest),
            speculative_n_max=_get(body, "speculative_n_max", int, None, bad=BadRequest),
        )
        params.validate()
        return params

    def validate(self) -> None:
        """BadRequest naming the first parameter out of its range. Parameters seen valid lately pass at once
        (a frozen value is valid or not for good; clients tend to send the same ones)."""
        try:
            if self in _VALID:
                return
        except TypeError:  # a list where a tuple goes (made by hand, not decoded): checked every time
            self._check()
            return
        self._check()
        if len(_VALID) >= _VALID_KEPT:
            _VALID.clear()
        _VALID.add(self)

    def _check(self) -> None:
        _ranged("max_tokens", self.max_tokens, 1, MAX_TOKENS_LIMIT)
        _ranged("temperature", self.temperature, 0.0, 100.0)
        _ranged("top_p", self.top_p, 0.0, 1.0)
        _ranged("top_k", self.top_k, 0, 1 << 20)
        _ranged("repeat_penalty", self.repeat_penalty, 0.01, 100.0)
        if self.seed is not None:
            _ranged("seed", self.seed, 0, 2**32 - 1)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise BadRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
                raise BadRequest(f"each stop string must be a non-empty string of at most "
                                 f"{MAX_STOP_CHARS} characters, got {s!r:.60}")
        _ranged("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _ranged("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _ranged("min_p", self.min_p, 0.0, 1.0)
        _ranged("typical_p", self.typical_p, 0.0, 1.0)
        if not isinstance(self.ignore_eos, bool):
            raise BadRequest(f"'ignore_eos' must be a boolean, got {type(self.ignore_eos).__name__}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise BadRequest(f"'logit_bias' may bias at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for _, bias in self.logit_bias:
            _ranged("logit_bias", bias, -100.0, 100.0)
        if self.logprobs is not None:
            _ranged("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        if not isinstance(self.prompt_logprobs, bool):
            raise BadRequest(f"'prompt_logprobs' must be a boolean, got {type(self.prompt_logprobs).__name__}")
        if self.prompt_logprobs and self.logprobs is None:
            raise BadRequest("'prompt_logprobs' needs 'logprobs' (the number of top tokens to report, 0..20)")
        _ranged("n", self.n, 1, MAX_CHOICES)
        if self.speculative_n_max is not None:
            _ranged("speculative_n_max", self.speculative_n_max, 0, 64)

        for key, most in (("grammar", structured.MAX_GRAMMAR_CHARS), ("json_schema", structured.MAX_SCHEMA_CHARS)):
            value = getattr(self, key)
            if not isinstance(value, (str, type(None))):
                raise BadRequest(f"'{key}' must be a string")
            if value is not None:
                _limit(key, value, most, BadRequest)
        if self.grammar is not None and self.json_schema is not None:
            raise BadRequest("give 'grammar' or 'json_schema', not both")
        if self.grammar is not None:
            structured.check_grammar(self.grammar)
        if self.json_schema is not None:
            structured.schema_grammar(self.json_schema)  # compiled once per distinct schema, then cached

    def choice_params(self, index: int) -> GenerateParams:
        """Choice ``index``'s parameters: one choice, seeded with seed + index (modulo 2**32) when seeded."""
        seed = None if self.seed is None else (self.seed + index) % 2**32
        return msgspec.structs.replace(self, n=1, seed=seed)


_VALID: set[GenerateParams] = set()
_VALID_KEPT = 1024
_DEFAULT_PARAMS = GenerateParams()
_PARAM_NAMES = frozenset(GenerateParams.__struct_fields__)


def logit_bias_pairs(value: Any) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs, from OpenAI's map (token ids as integers or as the strings
    JSON keys are) or from the wire's list of pairs. Ranges are checked by ``GenerateParams.validate``."""
    items = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(items, (list, tuple)):
        raise BadRequest(f"'logit_bias' must be a map of token ids to biases, got {type(value).__name__}")
    pairs = []
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise BadRequest("'logit_bias' must be a map of token ids to biases")
        token, bias = item
        if isinstance(token, str) and token.isascii() and token.isdigit():
            token = int(token)
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MAX_TOKEN_ID:
            raise BadRequest(f"'logit_bias' keys must be token ids (integers from 0 to {MAX_TOKEN_ID}), "
                             f"got {token!r:.40}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise BadRequest(f"'logit_bias' values must be numbers, got {bias!r:.40}")
        pairs.append((token, float(bias)))
    return tuple(pairs)


class Request(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """client -> broker: generate a completion. ``timeout`` (seconds) covers queueing and running."""

    TYPE: ClassVar[MsgType] = MsgType.REQUEST
    id: str
    prompt: str
    model: str | None = None
    params: GenerateParams = msgspec.field(default_factory=GenerateParams)
    stream: bool = False
    timeout: float | None = None
    tokens: bytes = b""  # a prompt of token ids (pack_tokens), taken as it is, instead of ``prompt``

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Request:
        timeout = _get(body, "timeout", (int, float), None, bad=BadRequest)
        request = cls(
            id=_text(body, "id", MAX_ID_CHARS),
            prompt=_get(body, "prompt", str, bad=BadRequest),
            model=_get(body, "model", str, None, bad=BadRequest),
            params=GenerateParams.from_wire(_get(body, "params", dict, {}, bad=BadRequest)),
            stream=_get(body, "stream", bool, False, bad=BadRequest),
            timeout=None if timeout is None else float(timeout),
            tokens=_get(body, "tokens", bytes, b"", bad=BadRequest),
        )
        request.check()
        return request

    def check(self) -> None:
        """The rules a well-typed request must still meet (``from_wire`` checks the types), in the order
        ``from_wire`` meets them."""
        _limit("id", self.id, MAX_ID_CHARS, ProtocolError)
        self.params.validate()
        if self.timeout is not None:
            _ranged("timeout", self.timeout, 0.001, 7 * 24 * 3600)
        if len(self.tokens) > 4 * MAX_PROMPT_CHARS:
            raise BadRequest(f"at most {MAX_PROMPT_CHARS} prompt tokens, got {len(self.tokens) // 4}")
        if any(t < 0 for t in unpack_tokens(self.tokens)):
            raise BadRequest("prompt token ids must be >= 0")
        _limit("prompt", self.prompt, MAX_PROMPT_CHARS, BadRequest)
        if self.model is not None:
            _limit("model", self.model, 256, BadRequest)


@dataclass(frozen=True)
class Cancel:
    """client -> broker, broker -> worker: stop request ``id`` (a client's id, or a worker's ticket)."""

    TYPE: ClassVar[MsgType] = MsgType.CANCEL
    id: str

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Cancel:
        return cls(id=_text(body, "id", MAX_ID_CHARS))


@dataclass(frozen=True)
class Ping:
    """client -> broker: liveness probe; answered by PONG. Any traffic counts as liveness."""

    TYPE: ClassVar[MsgType] = MsgType.PING
    nonce: int = 0

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Ping:
        return cls(nonce=_get(body, "nonce", int, 0))


@dataclass(frozen=True)
class Pong:
    TYPE: ClassVar[MsgType] = MsgType.PONG
    nonce: int = 0
    models: tuple[str, ...] = ()
    max_message_bytes: int = 0  # the largest message BODY the server takes; 0 (an older server): MAX_MESSAGE_BYTES

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Pong:
        return cls(nonce=_get(body, "nonce", int, 0), models=tuple(_get(body, "models", (list, tuple), ())),
                   max_message_bytes=_get(body, "max_message_bytes", int, 0))


@dataclass(frozen=True)
class StatsQuery:
    """client -> broker: ask for the broker's counters (for monitoring, e.g. the HTTP gateway)."""

    TYPE: ClassVar[MsgType] = MsgType.STATS_QUERY
    nonce: int = 0

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> StatsQuery:
        return cls(nonce=_get(body, "nonce", int, 0))


@dataclass(frozen=True)
class ModelScaling:
    """A model's instance bounds (``ceiling``: the most the server was sized for at start) and its scale
    events since start, by kind and reason (``start_queue``, ``stop_idle``, ``skip_does_not_fit``, ...)."""

    min: int = 0
    max: int = 0
    ceiling: int = 0
    starting: int = 0
    draining: int = 0
    events: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelStats:
    queued: int
    running: int
    instances: int  # registered and alive
    free_slots: int
    failed: str | None = None
    chat_template: str = ""  # the model's (Jinja2, from its GGUF), with the token texts it refers to
    bos_token: str = ""
    eos_token: str = ""
    oldest_wait_s: float = 0.0  # how long the request at the head of the queue has waited; 0 when none waits
    scaling: ModelScaling = ModelScaling()


@dataclass(frozen=True)
class WorkerStats:
    worker: str
    model: str
    host: str  # "" for this host's own workers
    pid: int
    device: int
    capacity: int
    running: int


@dataclass(frozen=True)
class Stats:
    """broker -> client: counters since start (accepted, done, timeout, retried, ... by name), and the
    state of each model's queue."""

    TYPE: ClassVar[MsgType] = MsgType.STATS
    nonce: int
    accepting: bool
    counters: dict[str, int]
    models: dict[str, ModelStats]
    workers: list[WorkerStats] = field(default_factory=list)

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Stats:
        models = _get(body, "models", dict)
        return cls(
            nonce=_get(body, "nonce", int, 0), accepting=_get(body, "accepting", bool),
            counters={str(k): int(v) for k, v in _get(body, "counters", dict).items()},
            models={str(k): _model_stats(v) for k, v in models.items()},
            workers=[WorkerStats(**w) for w in _get(body, "workers", list, [])],
        )


def _known(cls: type, body: dict[str, Any]) -> dict[str, Any]:
    """The fields ``cls`` has: a newer sender's extra fields are left out."""
    return {k: v for k, v in body.items() if k in _field_names(cls)}


def _model_stats(body: dict[str, Any]) -> ModelStats:
    scaling = body.get("scaling")
    values = _known(ModelStats, body)
    values["scaling"] = ModelScaling(**_known(ModelScaling, scaling)) if isinstance(scaling, dict) else ModelScaling()
    return ModelStats(**values)


CONTROL_OPS = ("models", "load", "unload", "scale", "add")
MAX_INSTANCES = 256


@dataclass(frozen=True)
class Control:
    """client -> broker: an operator's call, answered by CONTROL_REPLY or ERROR with the same ``id``.

    ``models`` lists the models; ``load`` starts a model's instances (min at least 1); ``unload`` drains them
    all (min 0: the next request loads it again); ``scale`` sets ``min`` and/or ``max``; ``add`` serves the GGUF
    at ``path`` as a new model (``model`` names it; the file's stem if None) with ``min`` (1) .. ``max``."""

    TYPE: ClassVar[MsgType] = MsgType.CONTROL
    id: str
    op: str
    model: str | None = None
    min: int | None = None
    max: int | None = None
    path: str | None = None

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Control:
        msg = cls(id=_text(body, "id", MAX_ID_CHARS), op=_text(body, "op", 16, bad=BadRequest),
                  model=_text(body, "model", 256, None, bad=BadRequest),
                  min=_get(body, "min", int, None, bad=BadRequest), max=_get(body, "max", int, None, bad=BadRequest),
                  path=_text(body, "path", 4096, None, bad=BadRequest))
        msg.validate()
        return msg

    def validate(self) -> None:
        if self.op not in CONTROL_OPS:
            raise BadRequest(f"'op' must be one of {', '.join(CONTROL_OPS)}, got {self.op!r}")
        if self.op not in ("models", "add") and self.model is None:
            raise BadRequest(f"'model' is needed for {self.op}")
        if (self.op == "add") != (self.path is not None):
            raise BadRequest("'path' is needed for add" if self.op == "add" else f"'path' is for add, not {self.op}")
        if self.op == "scale" and self.min is None and self.max is None:
            raise BadRequest("scale needs 'min', 'max' or both")
        if self.min is not None:
            _ranged("min", self.min, 0, MAX_INSTANCES)
        if self.max is not None:
            _ranged("max", self.max, 1, MAX_INSTANCES)
        if self.min is not None and self.max is not None and self.min > self.max:
            raise BadRequest(f"'min' ({self.min}) is above 'max' ({self.max})")


@dataclass(frozen=True)
class ModelControl:
    """One model in a CONTROL_REPLY: instances taking requests, starting and draining; bounds; state (ready,
    starting, scaled to zero, failed)."""

    name: str
    path: str
    instances: int
    starting: int
    draining: int
    min: int
    max: int
    ceiling: int
    state: str


@dataclass(frozen=True)
class ControlReply:
    """broker -> client: what a CONTROL call did (``message``) and every model after it."""

    TYPE: ClassVar[MsgType] = MsgType.CONTROL_REPLY
    id: str
    message: str
    models: list[ModelControl] = field(default_factory=list)

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> ControlReply:
        return cls(id=_text(body, "id", MAX_ID_CHARS), message=_text(body, "message", 4096),
                   models=[ModelControl(**_known(ModelControl, m)) for m in _get(body, "models", list, [])
                           if isinstance(m, dict)])


@dataclass(frozen=True)
class Logprobs:
    """Log-probabilities of generated tokens (log-softmax of the raw logits, before any sampler), in columns
    of packed numbers: a completion can have more tokens than a msgpack list may hold here. For each sampled
    token: its id and log-probability, and the ``top`` most probable tokens, most probable first; ``pieces``
    holds each sampled token's bytes followed by its top tokens' bytes, ending at the offsets ``piece_ends``.

    Asked for with ``prompt_logprobs``, the first ``prompt`` entries are the prompt's tokens (a leading BOS is
    left out: its text is no part of the prompt), each scored given the tokens before it; a first token that
    nothing precedes has log-probability NaN and top entries of id -1, no bytes and NaN."""

    top: int = 0
    tokens: bytes = b""  # int32 (pack_tokens)
    logprobs: bytes = b""  # float64, little-endian
    top_tokens: bytes = b""  # int32, ``top`` per sampled token
    top_logprobs: bytes = b""  # float64
    pieces: bytes = b""
    piece_ends: bytes = b""  # int32
    prompt: int = 0  # leading entries that are prompt tokens

    @classmethod
    def from_wire(cls, body: Any) -> Logprobs | None:
        if body is None:
            return None
        if not isinstance(body, dict):
            raise ProtocolError("field 'logprobs' must be a map")
        lp = cls(top=_get(body, "top", int), **{k: _get(body, k, bytes) for k in (
            "tokens", "logprobs", "top_tokens", "top_logprobs", "pieces", "piece_ends")},
                 prompt=_get(body, "prompt", int, 0))
        n = len(lp.tokens) // 4
        if not 0 <= lp.prompt <= n:
            raise ProtocolError(f"field 'prompt' of 'logprobs' must be 0..{n}, got {lp.prompt}")
        if (len(lp.tokens) != 4 * n or len(lp.logprobs) != 8 * n or len(lp.top_tokens) != 4 * n * lp.top
                or len(lp.top_logprobs) != 8 * n * lp.top or len(lp.piece_ends) != 4 * n * (1 + lp.top)):
            raise ProtocolError("the columns of 'logprobs' do not have matching lengths")
        return lp

    @staticmethod
    def join(parts: Sequence[Logprobs]) -> Logprobs | None:
        """One Logprobs of several in order (a streamed completion's chunks)."""
        if not parts:
            return None
        ends, base = [], 0
        for part in parts:
            ends += [base + e for e in unpack_tokens(part.piece_ends)]
            base += len(part.pieces)
        columns = {k: b"".join(getattr(p, k) for p in parts)
                   for k in ("tokens", "logprobs", "top_tokens", "top_logprobs", "pieces")}
        return Logprobs(parts[0].top, **columns, piece_ends=pack_tokens(ends), prompt=sum(p.prompt for p in parts))

    def entries(self) -> list[tuple[int, bytes, float, list[tuple[int, bytes, float]]]]:
        """Per sampled token: (id, bytes, log-probability, [(id, bytes, log-probability) of the top ones])."""
        n, top = len(self.tokens) // 4, self.top
        ids, top_ids = unpack_tokens(self.tokens), unpack_tokens(self.top_tokens)
        lps = struct.unpack(f"<{n}d", self.logprobs)
        top_lps = struct.unpack(f"<{n * top}d", self.top_logprobs)
        ends = unpack_tokens(self.piece_ends)
        starts = [0, *ends]
        pieces = [self.pieces[a:b] for a, b in zip(starts, ends, strict=False)]
        out = []
        for i in range(n):
            j = i * (1 + top)
            out.append((ids[i], pieces[j], lps[i], [(top_ids[i * top + k], pieces[j + 1 + k], top_lps[i * top + k])
                                                    for k in range(top)]))
        return out


@dataclass(frozen=True)
class Chunk:
    """A piece of streamed text for request ``id`` (with the log-probabilities of its tokens, if asked)."""

    TYPE: ClassVar[MsgType] = MsgType.CHUNK
    id: str
    text: str
    logprobs: Logprobs | None = None
    index: int = 0  # the choice, of a request for n

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Chunk:
        return cls(id=_text(body, "id", MAX_ID_CHARS), text=_text(body, "text", MAX_PROMPT_CHARS),
                   logprobs=Logprobs.from_wire(body.get("logprobs")), index=_choice(body))


@dataclass(frozen=True)
class Chunks:
    """Several CHUNKs in one message (of different requests, or of one), in the order they were made."""

    TYPE: ClassVar[MsgType] = MsgType.CHUNKS
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Timings:
    """Milliseconds. ``queue_ms``: accepted by the broker until assigned; ``prompt_ms``: assigned until
    the first token; ``generate_ms``: first token until the last. For a request handed over (``attempts`` > 1)
    the whole request's, as its client saw it: queued until first assigned, the first token it got, and the
    generation across the hand-over."""

    queue_ms: float = 0.0
    prompt_ms: float = 0.0
    generate_ms: float = 0.0
    attempts: int = 1
    cached_tokens: int = 0  # prompt tokens taken from the slot's KV cache instead of computed
    draft_tokens: int = 0  # speculative decoding: tokens proposed and verified
    accepted_tokens: int = 0  # of those, the ones the sequence kept


@dataclass(frozen=True)
class Done:
    """Terminal success for request ``id``. ``text`` is the whole completion, streamed or not.
    ``finish_reason``: "length" (max_tokens reached), "stop" (end of text or a stop string)."""

    TYPE: ClassVar[MsgType] = MsgType.DONE
    id: str
    text: str
    finish_reason: str
    usage: Usage
    timings: Timings
    worker: str = ""
    logprobs: Logprobs | None = None  # streamed: those of tokens no CHUNK carried
    index: int = 0  # the choice: a request for n gets n DONEs, one per choice

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Done:
        u = _get(body, "usage", dict)
        t = _get(body, "timings", dict)
        return cls(
            id=_text(body, "id", MAX_ID_CHARS),
            text=_text(body, "text", MAX_PROMPT_CHARS * 4),
            finish_reason=_text(body, "finish_reason", 32),
            usage=Usage(_get(u, "prompt_tokens", int), _get(u, "completion_tokens", int)),
            timings=Timings(float(_get(t, "queue_ms", (int, float))), float(_get(t, "prompt_ms", (int, float))),
                            float(_get(t, "generate_ms", (int, float))), attempts=_get(t, "attempts", int, 1),
                            cached_tokens=_get(t, "cached_tokens", int, 0),
                            draft_tokens=_get(t, "draft_tokens", int, 0),
                            accepted_tokens=_get(t, "accepted_tokens", int, 0)),
            worker=_text(body, "worker", 64, ""), logprobs=Logprobs.from_wire(body.get("logprobs")),
            index=_choice(body),
        )


def _choice(body: dict[str, Any]) -> int:
    index: int = _get(body, "index", int, 0)
    _index(index)
    return index


def _index(index: int) -> None:
    if not 0 <= index < MAX_CHOICES:
        raise ProtocolError(f"field 'index' must be 0..{MAX_CHOICES - 1}, got {index}")


@dataclass(frozen=True)
class Error:
    """Terminal failure for request ``id`` (None when the failing message carried no usable id).
    ``code`` is one of the stable codes in ``mpserve.errors``."""

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    id: str | None
    code: str
    message: str
    retry_after: float | None = None

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Error:
        retry = _get(body, "retry_after", (int, float), None)
        return cls(id=_text(body, "id", MAX_ID_CHARS, None), code=_text(body, "code", 64),
                   message=_text(body, "message", 64 * 1024), retry_after=None if retry is None else
                   float(retry))


@dataclass(frozen=True)
class Ready:
    """worker -> broker: able to take ``capacity`` requests at once. ``loaded`` False: the model is not in
    memory yet (single active backend) and will be loaded by the first request."""

    TYPE: ClassVar[MsgType] = MsgType.READY
    worker: str
    model: str
    device: int
    capacity: int
    pid: int
    loaded: bool = True
    host: str = ""  # set by workers of remote pools
    protocol: str = WORKER_LINK
    chat_template: str = ""  # the model's chat template (Jinja2, from its GGUF; "" if none or not loaded)
    bos_token: str = ""
    eos_token: str = ""
    proof: str = ""  # the broker's per-start secret, from its own workers only (mpserve.server.link)

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Ready:
        return cls(worker=_text(body, "worker", MAX_ID_CHARS), model=_text(body, "model", 256),
                   device=_get(body, "device", int), capacity=_get(body, "capacity", int),
                   pid=_get(body, "pid", int), loaded=_get(body, "loaded", bool, True),
                   host=_text(body, "host", 256, ""), protocol=_text(body, "protocol", 16),
                   chat_template=_text(body, "chat_template", MAX_TEMPLATE_CHARS, ""),
                   bos_token=_text(body, "bos_token", 256, ""), eos_token=_text(body, "eos_token", 256, ""),
                   proof=_text(body, "proof", 64, ""))


@dataclass(frozen=True)
class Heartbeat:
    """Both ways between broker and workers, every heartbeat interval (any other traffic counts too).
    From the broker, ``registered`` False tells a worker the broker does not know it (it was declared
    lost, or the broker restarted): the worker registers again with READY."""

    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    worker: str
    registered: bool = True

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Heartbeat:
        return cls(worker=_text(body, "worker", MAX_ID_CHARS), registered=_get(body, "registered", bool, True))


@dataclass(frozen=True)
class Failed:
    """worker -> broker: the model could not be loaded; the worker exits after sending this. A local worker
    sends it before its READY, so it carries the same ``proof`` (``mpserve.server.link``)."""

    TYPE: ClassVar[MsgType] = MsgType.FAILED
    worker: str
    model: str
    message: str
    proof: str = ""

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Failed:
        return cls(worker=_text(body, "worker", 64), model=_text(body, "model", 256),
                   message=_text(body, "message", 64 * 1024), proof=_text(body, "proof", 64, ""))


@dataclass(frozen=True)
class Unloaded:
    """worker -> broker: the model is out of memory (after UNLOAD, or the idle watchdog)."""

    TYPE: ClassVar[MsgType] = MsgType.UNLOADED
    worker: str

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Unloaded:
        return cls(worker=_text(body, "worker", 64))


@dataclass(frozen=True)
class Leaving:
    """worker -> broker: this worker is exiting (told to stop, terminated, or the server or pool that started it
    is gone), now: the broker forgets it at once and hands over the requests it ran, which it does not answer."""

    TYPE: ClassVar[MsgType] = MsgType.LEAVING
    worker: str
    reason: str = ""

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Leaving:
        return cls(worker=_text(body, "worker", 64), reason=_text(body, "reason", 256, ""))


@dataclass(frozen=True)
class Unload:
    """broker -> worker: free the model (single active backend: another model gets the device)."""

    TYPE: ClassVar[MsgType] = MsgType.UNLOAD
    reason: str = ""

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Unload:
        return cls(reason=_text(body, "reason", 256, ""))


class Assign(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """broker -> worker: run ``request``; echo ``ticket`` on every CHUNK/DONE/ERROR for it."""

    TYPE: ClassVar[MsgType] = MsgType.ASSIGN
    ticket: str
    request: Request
    queue_ms: float
    attempt: int
    slot: int = 0  # which of the worker's slots: the broker picks the one whose cache fits the prompt
    report_tokens: bool = False  # send each CHUNK's token ids (a TOKENS frame), so it can be resumed elsewhere
    generated: bytes = b""  # resuming: the tokens the lost instance streamed (a TOKENS frame's encoding)
    index: int = 0  # the choice this assignment is, of a request for n (its request asks for one)

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Assign:
        assign = cls(ticket=_get(body, "ticket", str), request=Request.from_wire(_get(body, "request", dict)),
                     queue_ms=float(_get(body, "queue_ms", (int, float))), attempt=_get(body, "attempt", int),
                     slot=_get(body, "slot", int, 0), report_tokens=_get(body, "report_tokens", bool, False),
                     generated=_get(body, "generated", bytes, b""), index=_get(body, "index", int, 0))
        assign.check(request=False)
        return assign

    def check(self, request: bool = True) -> None:
        """The rules a well-typed assignment must still meet (its request's first, unless already checked)."""
        if request:
            self.request.check()
        if len(self.generated) % 4 or len(self.generated) > 4 * MAX_TOKENS_LIMIT:
            raise ProtocolError(f"field 'generated' must be int32 token ids, at most {MAX_TOKENS_LIMIT}")
        _limit("ticket", self.ticket, MAX_ID_CHARS, ProtocolError)
        _index(self.index)


@dataclass(frozen=True)
class Assigns:
    """Several ASSIGNs for one worker in one message, in the order the broker made them."""

    TYPE: ClassVar[MsgType] = MsgType.ASSIGNS
    assigns: tuple[Assign, ...]


@dataclass(frozen=True)
class Stop:
    """broker -> worker: finish nothing new and exit."""

    TYPE: ClassVar[MsgType] = MsgType.STOP
    reason: str = ""

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Stop:
        return cls(reason=_text(body, "reason", 256, ""))


@dataclass(frozen=True)
class CacheChanges:
    """worker -> broker, the CACHE frame after a DONE or ERROR: what the instance's host-RAM prompt cache gained
    (``added``: an entry's id and its summary, the block hashes of the prompt text it holds,
    ``mpserve.wire.prefix.block_hashes``, as uint64 little-endian) and lost (``dropped``: ids) since the previous
    CACHE frame. After a READY it is the whole cache (what a broker that restarted learns it from): the most
    recently used entries, up to MAX_CACHE_ITEMS entries and MAX_CACHE_HASHES hashes, nothing dropped. Ids are
    the worker's, unique while its model stays loaded."""

    added: tuple[tuple[int, bytes], ...] = ()
    dropped: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.dropped)

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> CacheChanges:
        added = []
        for item in _get(body, "added", list, []):
            if not (isinstance(item, list) and len(item) == 2 and _cache_id(item[0]) and isinstance(item[1], bytes)
                    and len(item[1]) % 8 == 0 and len(item[1]) <= 8 * MAX_BLOCKS):
                raise ProtocolError(f"a CACHE entry must be [id, at most {MAX_BLOCKS} uint64 hashes]")
            added.append((item[0], item[1]))
        dropped = _get(body, "dropped", list, [])
        if not all(_cache_id(i) for i in dropped):
            raise ProtocolError("CACHE 'dropped' must be entry ids")
        return cls(tuple(added), tuple(dropped))


def _cache_id(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**63


def frame_cache(frame: bytes) -> CacheChanges:
    return CacheChanges.from_wire(unpack_body(frame))


def pack_hashes(hashes: Sequence[int]) -> bytes:
    """Block hashes as a CACHE entry carries them: uint64, little-endian."""
    return struct.pack(f"<{len(hashes)}Q", *hashes)


def unpack_hashes(data: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(data) // 8}Q", data)


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as they travel: int32, little-endian (a msgpack list is capped at a few thousand items)."""
    try:
        return struct.pack(f"<{len(tokens)}i", *tokens)
    except struct.error:
        raise BadRequest(f"token ids must be integers from 0 to {MAX_TOKEN_ID}") from None


def unpack_tokens(data: bytes, key: str = "tokens") -> list[int]:
    if len(data) % 4:
        raise ProtocolError(f"field '{key}' must hold int32 token ids, got {len(data)} bytes")
    return list(struct.unpack(f"<{len(data) // 4}i", data))


@dataclass(frozen=True)
class Tokenize:
    """client -> broker -> worker: ``text`` to tokens with the vocabulary of ``model`` (``add_special``: the
    model's BOS too; specials written in the text are parsed), or, with ``detokenize``, ``tokens`` to text.
    The broker sends it to a loaded instance of the model, with ``ticket`` set; answered by TOKENS or ERROR."""

    TYPE: ClassVar[MsgType] = MsgType.TOKENIZE
    id: str
    model: str | None = None
    text: str = ""
    tokens: bytes = b""  # pack_tokens
    detokenize: bool = False
    add_special: bool = False
    with_pieces: bool = False
    timeout: float | None = None
    ticket: str = ""

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Tokenize:
        tokens = _get(body, "tokens", bytes, b"", bad=BadRequest)
        if len(tokens) > 4 * MAX_PROMPT_CHARS:
            raise BadRequest(f"at most {MAX_PROMPT_CHARS} tokens, got {len(tokens) // 4}")
        unpack_tokens(tokens)
        timeout = _get(body, "timeout", (int, float), None, bad=BadRequest)
        if timeout is not None:
            _ranged("timeout", timeout, 0.001, 7 * 24 * 3600)
        return cls(id=_text(body, "id", MAX_ID_CHARS), model=_text(body, "model", 256, None, bad=BadRequest),
                   text=_text(body, "text", MAX_PROMPT_CHARS, "", bad=BadRequest), tokens=tokens,
                   detokenize=_get(body, "detokenize", bool, False, bad=BadRequest),
                   add_special=_get(body, "add_special", bool, False, bad=BadRequest),
                   with_pieces=_get(body, "with_pieces", bool, False, bad=BadRequest),
                   timeout=None if timeout is None else float(timeout), ticket=_text(body, "ticket", MAX_ID_CHARS, ""))


@dataclass(frozen=True)
class Tokens:
    """worker -> broker -> client: the answer to TOKENIZE ``id``: ``tokens`` (pack_tokens) and ``text``; with
    ``with_pieces``, each token's bytes, concatenated in ``pieces``, ending at the offsets ``piece_ends``."""

    TYPE: ClassVar[MsgType] = MsgType.TOKENS
    id: str
    tokens: bytes = b""
    text: str = ""
    pieces: bytes = b""
    piece_ends: bytes = b""  # pack_tokens of the offsets

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Tokens:
        msg = cls(id=_text(body, "id", MAX_ID_CHARS), tokens=_get(body, "tokens", bytes, b""),
                  text=_text(body, "text", MAX_PROMPT_CHARS * 4, ""), pieces=_get(body, "pieces", bytes, b""),
                  piece_ends=_get(body, "piece_ends", bytes, b""))
        unpack_tokens(msg.tokens)
        unpack_tokens(msg.piece_ends, "piece_ends")
        return msg


@dataclass(frozen=True)
class Embed:
    """client -> broker -> worker: the embeddings of ``texts``, or of ``tokens`` (one pack_tokens per input),
    by the embedding model ``model``; with ``query``, a reranker's score of each text against it (EMBEDDINGS of
    one number each). The broker sends it to the least busy loaded instance of the model, with
    ``ticket`` set, as it sends TOKENIZE; answered by EMBEDDINGS or ERROR."""

    TYPE: ClassVar[MsgType] = MsgType.EMBED
    id: str
    model: str | None = None
    texts: tuple[str, ...] = ()
    tokens: tuple[bytes, ...] = ()
    timeout: float | None = None
    ticket: str = ""
    query: str | None = None  # a rerank: the texts are documents, each scored against this query

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Embed:
        texts = _get(body, "texts", (list, tuple), (), bad=BadRequest)
        tokens = _get(body, "tokens", (list, tuple), (), bad=BadRequest)
        if bool(texts) == bool(tokens):
            raise BadRequest("'input' must be texts or token arrays, not empty")
        if len(texts) + len(tokens) > MAX_EMBED_INPUTS:
            raise BadRequest(f"'input' may hold at most {MAX_EMBED_INPUTS} inputs, got {len(texts) + len(tokens)}")
        if not all(isinstance(t, str) and 0 < len(t) <= MAX_PROMPT_CHARS for t in texts):
            raise BadRequest(f"each 'input' text must be a non-empty string of at most {MAX_PROMPT_CHARS} characters")
        if not all(isinstance(t, bytes) and t and not any(i < 0 for i in unpack_tokens(t, "input")) for t in tokens):
            raise BadRequest("each 'input' token array must be a non-empty list of token ids >= 0")
        timeout = _get(body, "timeout", (int, float), None, bad=BadRequest)
        if timeout is not None:
            _ranged("timeout", timeout, 0.001, 7 * 24 * 3600)
        query = _text(body, "query", MAX_PROMPT_CHARS, None, bad=BadRequest)
        if query is not None and (tokens or not query):
            raise BadRequest("a rerank takes a non-empty 'query' and documents as texts")
        return cls(id=_text(body, "id", MAX_ID_CHARS), model=_text(body, "model", 256, None, bad=BadRequest),
                   texts=tuple(texts), tokens=tuple(tokens), timeout=None if timeout is None else float(timeout),
                   ticket=_text(body, "ticket", MAX_ID_CHARS, ""), query=query)


@dataclass(frozen=True)
class Embeddings:
    """worker -> broker -> client: the answer to EMBED ``id``: one L2-normalised vector of ``dim`` float32
    (little-endian) per input, in order, concatenated in ``vectors``; ``prompt_tokens``: the inputs' tokens."""

    TYPE: ClassVar[MsgType] = MsgType.EMBEDDINGS
    id: str
    dim: int
    vectors: bytes
    prompt_tokens: int = 0

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Embeddings:
        msg = cls(id=_text(body, "id", MAX_ID_CHARS), dim=_get(body, "dim", int), vectors=_get(body, "vectors", bytes),
                  prompt_tokens=_get(body, "prompt_tokens", int, 0))
        if msg.dim < 1 or len(msg.vectors) % (4 * msg.dim):
            raise ProtocolError(f"field 'vectors' must hold float32 vectors of {msg.dim}, got {len(msg.vectors)} bytes")
        return msg

    def rows(self) -> list[list[float]]:
        n = len(self.vectors) // (4 * self.dim)
        flat = struct.unpack(f"<{n * self.dim}f", self.vectors)
        return [list(flat[i * self.dim:(i + 1) * self.dim]) for i in range(n)]
SLOT_ACTIONS = ("save", "restore", "erase")
MAX_FILENAME_CHARS = 128


@dataclass(frozen=True)
class SlotAction:
    """client -> broker -> worker: ``save`` slot ``slot`` of instance ``worker`` (its identity: w0, w1, ...) to
    ``filename`` in the model's ``slot_save_path``, ``restore`` it from there, or ``erase`` its cells. The broker
    sends it to that worker with ``ticket`` set; answered by SLOT_REPLY or ERROR."""

    TYPE: ClassVar[MsgType] = MsgType.SLOT_ACTION
    id: str
    worker: str
    slot: int
    action: str
    filename: str = ""
    ticket: str = ""

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> SlotAction:
        msg = cls(id=_text(body, "id", MAX_ID_CHARS), worker=_text(body, "worker", MAX_ID_CHARS, bad=BadRequest),
                  slot=_get(body, "slot", int, bad=BadRequest), action=_text(body, "action", 16, bad=BadRequest),
                  filename=_text(body, "filename", MAX_FILENAME_CHARS, "", bad=BadRequest),
                  ticket=_text(body, "ticket", MAX_ID_CHARS, ""))
        msg.validate()
        return msg

    def validate(self) -> None:
        if self.action not in SLOT_ACTIONS:
            raise BadRequest(f"'action' must be one of {', '.join(SLOT_ACTIONS)}, got {self.action!r}")
        _ranged("slot", self.slot, 0, 1023)
        if self.action != "erase" and not self.filename:
            raise BadRequest(f"{self.action} needs a 'filename'")


@dataclass(frozen=True)
class SlotReply:
    """worker -> broker -> client: what SLOT_ACTION ``id`` did: the tokens saved, restored or erased, the file's
    bytes (save, restore) and the milliseconds it took."""

    TYPE: ClassVar[MsgType] = MsgType.SLOT_REPLY
    id: str
    action: str
    tokens: int
    bytes: int = 0
    ms: float = 0.0

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> SlotReply:
        return cls(id=_text(body, "id", MAX_ID_CHARS), action=_text(body, "action", 16),
                   tokens=_get(body, "tokens", int), bytes=_get(body, "bytes", int, 0),
                   ms=float(_get(body, "ms", (int, float), 0.0)))


_DECODERS: dict[MsgType, Any] = {
    cls.TYPE: cls.from_wire
    for cls in (Request, Cancel, Ping, StatsQuery, Pong, Stats, Chunk, Done, Error, Ready, Heartbeat, Failed,
                Unloaded, Leaving, Assign, Stop, Unload, Tokenize, Tokens, Control, ControlReply,
                Embed, Embeddings, SlotAction, SlotReply)
}


# --- encoding and decoding ----------------------------------------------------------------------

@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


_ENCODER = msgspec.msgpack.Encoder()


def pack(msg: Any) -> bytes:
    """A body: a message (msgspec Struct or dataclass, nested ones included) as the map of its fields, or
    plain data, encoded in C by msgspec."""
    return _ENCODER.encode(msg)


def encode(msg: Any) -> list[bytes]:
    """[VERSION, TYPE, BODY] for a message travelling to a client or a worker."""
    return [VERSION, TYPE_FRAMES[msg.TYPE], pack(msg)]


def encode_from_worker(msg: Any, ticket: str = "", trailer: bytes | None = None) -> list[bytes]:
    """[VERSION, TYPE, TICKET, BODY] for a message a worker sends to the broker; a CHUNK may add TOKENS, a DONE
    or ERROR for an ASSIGN and a READY a CACHE frame."""
    return worker_frames(msg.TYPE, ticket, pack(msg), trailer)


def worker_frames(mtype: MsgType, ticket: str, body: bytes, trailer: bytes | None = None) -> list[bytes]:
    """The frames of a worker's message whose body is packed already."""
    frames = [VERSION, TYPE_FRAMES[mtype], ticket.encode(), body]
    return frames if trailer is None else [*frames, trailer]


STEPPED = frozenset({MsgType.CHUNK, MsgType.DONE, MsgType.ERROR})  # what a STEP may carry


def encode_step(entries: Sequence[tuple[MsgType, str, bytes, bytes | None]]) -> list[bytes]:
    """[VERSION, STEP, b"", BATCH]: the (type, ticket, body, trailer or None) of one step, in one message."""
    batch = [[int(mtype), ticket, body, trailer] for mtype, ticket, body, trailer in entries]
    return [VERSION, TYPE_FRAMES[MsgType.STEP], b"", pack(batch)]


def step_entries(batch: bytes) -> list[tuple[MsgType, str, bytes, bytes | None]]:
    """The (type, ticket, body, trailer or None) entries of a worker's STEP, each one checked."""
    entries = []
    for entry in _unpack(batch, list):
        if not (isinstance(entry, list) and len(entry) == 4 and type(entry[0]) is int and isinstance(entry[1], str)
                and isinstance(entry[2], bytes) and isinstance(entry[3], (bytes, type(None)))):
            raise ProtocolError("a STEP entry must be [type, ticket, body, trailer or nil]")
        mtype = _TYPES.get(entry[0])
        if mtype not in STEPPED:
            raise ProtocolError(f"a STEP carries CHUNK, DONE and ERROR entries, not type {entry[0]}")
        entries.append((mtype, entry[1], entry[2], entry[3]))
    return entries


def encode_assigns(bodies: Sequence[bytes]) -> list[bytes]:
    """[VERSION, ASSIGNS, BATCH] from packed ASSIGN bodies (``pack``), or a plain ASSIGN for one."""
    if len(bodies) == 1:
        return [VERSION, TYPE_FRAMES[MsgType.ASSIGN], bodies[0]]
    return [VERSION, TYPE_FRAMES[MsgType.ASSIGNS], splice_array(bodies)]


def splice_array(bodies: Sequence[bytes]) -> bytes:
    """A msgpack array of bodies, each spliced in as it came (each is one msgpack map: an array's header
    followed by its items is the array): a CHUNKS to a client, an ASSIGNS to a worker."""
    n = len(bodies)
    head = bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else \
        b"\xdd" + n.to_bytes(4, "big")
    return head + b"".join(bodies)


def token_frame(tokens: Sequence[int]) -> bytes:
    """Token ids as a TOKENS frame (and ``Assign.generated``): int32, little-endian."""
    return struct.pack(f"<{len(tokens)}i", *tokens)


def frame_tokens(frame: bytes) -> list[int]:
    if len(frame) % 4:
        raise ProtocolError("a TOKENS frame must be int32 token ids")
    return list(struct.unpack(f"<{len(frame) // 4}i", frame))


def unpack_body(body: bytes) -> dict[str, Any]:
    """msgpack map with explicit limits; anything else is a ProtocolError."""
    return _map(_unpack(body, dict))


def _map(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ProtocolError(f"body must be a msgpack map, got {type(obj).__name__}")
    return obj


def _unpack(body: bytes, kind: type) -> Any:
    """msgpack ``kind`` (a map, or an array for CHUNKS) with explicit limits."""
    if len(body) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message body of {len(body)} bytes is over the limit of {MAX_MESSAGE_BYTES}")
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True,
                              max_str_len=MAX_MESSAGE_BYTES, max_bin_len=MAX_MESSAGE_BYTES,
                              max_array_len=4096, max_map_len=64, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"body is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, kind):
        raise ProtocolError(f"body must be a msgpack {'map' if kind is dict else 'array'}, got {type(obj).__name__}")
    return obj


_TYPES = {t.value: t for t in MsgType}  # a dict lookup: much cheaper than MsgType(value), once per message


def parse_header(frames: list[bytes], expected: int) -> MsgType:
    """Check frame count and version; return the message type."""
    if len(frames) != expected:
        raise ProtocolError(f"expected {expected} frames, got {len(frames)}")
    if frames[0] != VERSION:
        raise ProtocolError(f"unsupported protocol version {bytes(frames[0])[:16]!r}; this server speaks "
                            f"{VERSION.decode()}")
    if len(frames[1]) != 1:
        raise ProtocolError("message type frame must be one byte")
    mtype = _TYPES.get(frames[1][0])
    if mtype is None:
        raise ProtocolError(f"unknown message type 0x{frames[1][0]:02x}")
    return mtype


_TYPED: dict[MsgType, msgspec.msgpack.Decoder[Any]] = {  # the hot ones: a request crosses the wire twice
    MsgType.REQUEST: msgspec.msgpack.Decoder(Request),  # (REQUEST, ASSIGN), and msgspec decodes and type-checks
    MsgType.ASSIGN: msgspec.msgpack.Decoder(Assign),  # it in C
    MsgType.ASSIGNS: msgspec.msgpack.Decoder(tuple[Assign, ...]),
}


def decode_body(mtype: MsgType, body: bytes) -> Any:
    """A message body as its class. REQUEST and ASSIGN(S) are decoded by msgspec, then checked by the rules
    types cannot state; a body msgspec refuses goes the way of every other type, through ``from_wire``, which
    says what is wrong (or takes another encoding of the same message, such as an int for a float)."""
    typed = _TYPED.get(mtype)
    if typed is not None and len(body) <= MAX_MESSAGE_BYTES:
        try:
            msg = typed.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError):
            pass
        else:
            for one in msg if mtype is MsgType.ASSIGNS else (msg,):
                one.check()
            return Assigns(msg) if mtype is MsgType.ASSIGNS else msg
    if mtype is MsgType.CHUNKS:
        return Chunks(tuple(Chunk.from_wire(_map(item)) for item in _unpack(body, list)))
    if mtype is MsgType.ASSIGNS:
        return Assigns(tuple(Assign.from_wire(_map(item)) for item in _unpack(body, list)))
    return _DECODERS[mtype](unpack_body(body))


def decode(frames: list[bytes]) -> Any:
    """Decode a [VERSION, TYPE, BODY] message (to a client, or to a worker, or from a client)."""
    return decode_body(parse_header(frames, 3), frames[2])


def peek_id(body: bytes) -> str | None:
    """The ``id`` of a body that failed validation, so the error can still reach its request (also when
    another field, such as a too long prompt, is what failed)."""
    try:
        obj = msgpack.unpackb(body, raw=False, max_str_len=MAX_MESSAGE_BYTES, max_bin_len=MAX_MESSAGE_BYTES,
                              max_array_len=4096, max_map_len=64, max_ext_len=0)
    except Exception:
        return None
    rid = obj.get("id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) and len(rid) <= MAX_ID_CHARS else None
