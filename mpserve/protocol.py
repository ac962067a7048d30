"""The wire: the only module that knows how messages are framed and encoded.

Every message is a ZeroMQ multipart message. ROUTER sockets see a routing-identity frame first; that
frame belongs to ZeroMQ and is not described here.

    client  -> broker   [VERSION, TYPE, BODY]            REQUEST, CANCEL, PING, STATS_QUERY
    broker  -> client   [VERSION, TYPE, BODY]            CHUNK, DONE, ERROR, PONG, STATS
    broker  -> worker   [VERSION, TYPE, BODY]            ASSIGN, CANCEL, STOP, UNLOAD
    worker  -> broker   [VERSION, TYPE, TICKET, BODY]    READY, HEARTBEAT, FAILED, UNLOADED (empty TICKET);
                                                         CHUNK, DONE, ERROR (TICKET of an ASSIGN)
                        [VERSION, CHUNK, TICKET, BODY, TOKENS]  when the ASSIGN asked for ``report_tokens``

VERSION is ``b"MPS1"``. TYPE is one byte (``MsgType``). BODY is a msgpack map whose schema is the
frozen dataclass of that type below. TICKET is the broker's opaque key for one assignment: a worker
echoes it so the broker can forward the BODY of CHUNK/DONE/ERROR to the client unchanged (the worker
writes the client's own request id into it), without decoding and re-encoding every token. TOKENS is the
ids of the tokens generated since the previous CHUNK, int32 little-endian (``token_frame``): the broker
appends them without decoding anything, and hands them to the next instance if this one is lost
(``Assign.generated``), which continues the request from there.

Decoding never trusts the sender: bodies are unpacked with explicit size limits, every field is type-
and range-checked, and any problem raises ``ProtocolError`` (broken framing, unknown type, bad msgpack)
or ``BadRequest`` (a well-formed request with bad parameters), which the receiver answers or counts.
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

from .errors import BadRequest, ProtocolError

VERSION = b"MPS1"
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_TEMPLATE_CHARS = 256 * 1024  # a GGUF chat template; the longest known ones are tens of kilobytes
MAX_PROMPT_CHARS = 1024 * 1024
MAX_ID_CHARS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TOKENS_LIMIT = 1 << 20


class MsgType(IntEnum):
    REQUEST = 0x01
    CANCEL = 0x02
    PING = 0x03
    STATS_QUERY = 0x04
    CHUNK = 0x10
    DONE = 0x11
    ERROR = 0x12
    PONG = 0x13
    STATS = 0x14
    READY = 0x20
    HEARTBEAT = 0x21
    FAILED = 0x22
    UNLOADED = 0x23
    ASSIGN = 0x30
    STOP = 0x31
    UNLOAD = 0x32


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
    if value is not None and len(value) > max_chars:
        raise bad(f"field '{key}' is longer than {max_chars} characters")
    return value


# --- bodies -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template as it travels: read by the worker that loads the model (READY), kept by the
    broker per model (STATS), rendered by the gateway (``mpserve.gateway.chat``)."""

    template: str = ""  # Jinja2 source; "" when the model has none
    bos_token: str = ""
    eos_token: str = ""

    def __bool__(self) -> bool:
        return bool(self.template)


@dataclass(frozen=True)
class GenerateParams:
    """Sampling parameters, as llama.cpp takes them. temperature 0 means greedy."""

    max_tokens: int = 128
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    seed: int | None = None
    stop: tuple[str, ...] = ()
    repeat_penalty: float = 1.0

    @classmethod
    def from_wire(cls, body: Any) -> GenerateParams:
        if not isinstance(body, dict):
            raise BadRequest("'params' must be a map")
        unknown = set(body) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise BadRequest(f"unknown parameter(s) {sorted(map(str, unknown))}; allowed: "
                             f"{[f.name for f in dataclasses.fields(cls)]}")
        d = cls()
        num = (int, float)
        params = cls(
            max_tokens=_get(body, "max_tokens", int, d.max_tokens, bad=BadRequest),
            temperature=float(_get(body, "temperature", num, d.temperature, bad=BadRequest)),
            top_p=float(_get(body, "top_p", num, d.top_p, bad=BadRequest)),
            top_k=_get(body, "top_k", int, d.top_k, bad=BadRequest),
            seed=_get(body, "seed", int, None, bad=BadRequest),
            stop=tuple(_get(body, "stop", (list, tuple), (), bad=BadRequest)),
            repeat_penalty=float(_get(body, "repeat_penalty", num, d.repeat_penalty, bad=BadRequest)),
        )
        params.validate()
        return params

    def validate(self) -> None:
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


@dataclass(frozen=True)
class Request:
    """client -> broker: generate a completion. ``timeout`` (seconds) covers queueing and running."""

    TYPE: ClassVar[MsgType] = MsgType.REQUEST
    id: str
    prompt: str
    model: str | None = None
    params: GenerateParams = field(default_factory=GenerateParams)
    stream: bool = False
    timeout: float | None = None

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Request:
        rid = _text(body, "id", MAX_ID_CHARS)
        timeout = _get(body, "timeout", (int, float), None, bad=BadRequest)
        if timeout is not None:
            _ranged("timeout", timeout, 0.001, 7 * 24 * 3600)
        return cls(
            id=rid,
            prompt=_text(body, "prompt", MAX_PROMPT_CHARS, bad=BadRequest),
            model=_text(body, "model", 256, None, bad=BadRequest),
            params=GenerateParams.from_wire(_get(body, "params", dict, {}, bad=BadRequest)),
            stream=_get(body, "stream", bool, False, bad=BadRequest),
            timeout=None if timeout is None else float(timeout),
        )


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
            models={str(k): ModelStats(**v) for k, v in models.items()},
            workers=[WorkerStats(**w) for w in _get(body, "workers", list, [])],
        )


@dataclass(frozen=True)
class Chunk:
    """A piece of streamed text for request ``id``."""

    TYPE: ClassVar[MsgType] = MsgType.CHUNK
    id: str
    text: str

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Chunk:
        return cls(id=_text(body, "id", MAX_ID_CHARS), text=_text(body, "text", MAX_PROMPT_CHARS))


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
    the first token; ``generate_ms``: first token until the last."""

    queue_ms: float = 0.0
    prompt_ms: float = 0.0
    generate_ms: float = 0.0
    attempts: int = 1
    cached_tokens: int = 0  # prompt tokens taken from the slot's KV cache instead of computed


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
                            cached_tokens=_get(t, "cached_tokens", int, 0)),
            worker=_text(body, "worker", 64, ""),
        )


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
    protocol: str = VERSION.decode()
    chat_template: str = ""  # the model's chat template (Jinja2, from its GGUF; "" if none or not loaded)
    bos_token: str = ""
    eos_token: str = ""

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Ready:
        return cls(worker=_text(body, "worker", MAX_ID_CHARS), model=_text(body, "model", 256),
                   device=_get(body, "device", int), capacity=_get(body, "capacity", int),
                   pid=_get(body, "pid", int), loaded=_get(body, "loaded", bool, True),
                   host=_text(body, "host", 256, ""), protocol=_text(body, "protocol", 16),
                   chat_template=_text(body, "chat_template", MAX_TEMPLATE_CHARS, ""),
                   bos_token=_text(body, "bos_token", 256, ""), eos_token=_text(body, "eos_token", 256, ""))


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
    """worker -> broker: the model could not be loaded; the worker exits after sending this."""

    TYPE: ClassVar[MsgType] = MsgType.FAILED
    worker: str
    model: str
    message: str

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Failed:
        return cls(worker=_text(body, "worker", 64), model=_text(body, "model", 256),
                   message=_text(body, "message", 64 * 1024))


@dataclass(frozen=True)
class Unloaded:
    """worker -> broker: the model is out of memory (after UNLOAD, or the idle watchdog)."""

    TYPE: ClassVar[MsgType] = MsgType.UNLOADED
    worker: str

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Unloaded:
        return cls(worker=_text(body, "worker", 64))


@dataclass(frozen=True)
class Unload:
    """broker -> worker: free the model (single active backend: another model gets the device)."""

    TYPE: ClassVar[MsgType] = MsgType.UNLOAD
    reason: str = ""

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Unload:
        return cls(reason=_text(body, "reason", 256, ""))


@dataclass(frozen=True)
class Assign:
    """broker -> worker: run ``request``; echo ``ticket`` on every CHUNK/DONE/ERROR for it."""

    TYPE: ClassVar[MsgType] = MsgType.ASSIGN
    ticket: str
    request: Request
    queue_ms: float
    attempt: int
    slot: int = 0  # which of the worker's slots: the broker picks the one whose cache fits the prompt
    report_tokens: bool = False  # send each CHUNK's token ids (a TOKENS frame), so it can be resumed elsewhere
    generated: bytes = b""  # resuming: the tokens the lost instance streamed (a TOKENS frame's encoding)

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Assign:
        generated = _get(body, "generated", bytes, b"")
        if len(generated) % 4 or len(generated) > 4 * MAX_TOKENS_LIMIT:
            raise ProtocolError(f"field 'generated' must be int32 token ids, at most {MAX_TOKENS_LIMIT}")
        return cls(ticket=_text(body, "ticket", MAX_ID_CHARS),
                   request=Request.from_wire(_get(body, "request", dict)),
                   queue_ms=float(_get(body, "queue_ms", (int, float))),
                   attempt=_get(body, "attempt", int), slot=_get(body, "slot", int, 0),
                   report_tokens=_get(body, "report_tokens", bool, False), generated=generated)


@dataclass(frozen=True)
class Stop:
    """broker -> worker: finish nothing new and exit."""

    TYPE: ClassVar[MsgType] = MsgType.STOP
    reason: str = ""

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Stop:
        return cls(reason=_text(body, "reason", 256, ""))


_DECODERS: dict[MsgType, Any] = {
    cls.TYPE: cls.from_wire
    for cls in (Request, Cancel, Ping, StatsQuery, Pong, Stats, Chunk, Done, Error, Ready, Heartbeat, Failed,
                Unloaded, Assign, Stop, Unload)
}


# --- encoding and decoding ----------------------------------------------------------------------

def to_wire(msg: Any) -> Any:
    """A dataclass as plain msgpack-able data (faster than dataclasses.asdict, which deep-copies)."""
    names = _field_names(msg.__class__)
    if names:
        return {name: to_wire(getattr(msg, name)) for name in names}
    if isinstance(msg, dict):
        return {k: to_wire(v) for k, v in msg.items()}
    if isinstance(msg, list):
        return [to_wire(v) for v in msg]
    return msg


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else ()


def pack(msg: Any) -> bytes:
    packed: bytes = msgpack.packb(to_wire(msg), use_bin_type=True)
    return packed


def encode(msg: Any) -> list[bytes]:
    """[VERSION, TYPE, BODY] for a message travelling to a client or a worker."""
    return [VERSION, TYPE_FRAMES[msg.TYPE], pack(msg)]


def encode_from_worker(msg: Any, ticket: str = "", tokens: bytes | None = None) -> list[bytes]:
    """[VERSION, TYPE, TICKET, BODY] for a message a worker sends to the broker; a CHUNK may add TOKENS."""
    frames = [VERSION, TYPE_FRAMES[msg.TYPE], ticket.encode(), pack(msg)]
    return frames if tokens is None else [*frames, tokens]


def token_frame(tokens: Sequence[int]) -> bytes:
    """Token ids as a TOKENS frame (and ``Assign.generated``): int32, little-endian."""
    return struct.pack(f"<{len(tokens)}i", *tokens)


def frame_tokens(frame: bytes) -> list[int]:
    if len(frame) % 4:
        raise ProtocolError("a TOKENS frame must be int32 token ids")
    return list(struct.unpack(f"<{len(frame) // 4}i", frame))


def unpack_body(body: bytes) -> dict[str, Any]:
    """msgpack map with explicit limits; anything else is a ProtocolError."""
    if len(body) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message body of {len(body)} bytes is over the limit of {MAX_MESSAGE_BYTES}")
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True,
                              max_str_len=MAX_MESSAGE_BYTES, max_bin_len=MAX_MESSAGE_BYTES,
                              max_array_len=4096, max_map_len=64, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"body is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"body must be a msgpack map, got {type(obj).__name__}")
    return obj


def parse_header(frames: list[bytes], expected: int) -> MsgType:
    """Check frame count and version; return the message type."""
    if len(frames) != expected:
        raise ProtocolError(f"expected {expected} frames, got {len(frames)}")
    if frames[0] != VERSION:
        raise ProtocolError(f"unsupported protocol version {bytes(frames[0])[:16]!r}; this server speaks "
                            f"{VERSION.decode()}")
    if len(frames[1]) != 1:
        raise ProtocolError("message type frame must be one byte")
    try:
        return MsgType(frames[1][0])
    except ValueError:
        raise ProtocolError(f"unknown message type 0x{frames[1][0]:02x}") from None


def decode_body(mtype: MsgType, body: bytes) -> Any:
    return _DECODERS[mtype](unpack_body(body))


def decode(frames: list[bytes]) -> Any:
    """Decode a [VERSION, TYPE, BODY] message (to a client, or to a worker, or from a client)."""
    return decode_body(parse_header(frames, 3), frames[2])


def peek_id(body: bytes) -> str | None:
    """The ``id`` of a body that failed validation, so the error can still reach its request (also when
    another field, such as a too long prompt, is what failed)."""
    try:
        obj = msgpack.unpackb(body, raw=False, max_str_len=MAX_MESSAGE_BYTES, max_bin_len=0, max_array_len=4096,
                              max_map_len=64, max_ext_len=0)
    except Exception:
        return None
    rid = obj.get("id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) and len(rid) <= MAX_ID_CHARS else None
