"""The messages: every body that crosses the wire, as a frozen msgspec Struct, and the rules each one keeps.

    a body's bytes ─▶ msgspec (types and Meta limits, in C) ─▶ check() (rules across fields) ─▶ the message
                          │ refused                               │ refused
                          ▼                                       ▼
                      mpserve.wire.refusals: BadRequest or ProtocolError naming the field, its value and range

Each field is declared once: its type, its limits (``Annotated[..., Meta(ge=, le=, max_length=)]``), its
default and, for the sampling parameters, its meaning (``Meta(description=)``). The docs' wire tables, the
gateway's sampling names and the Node client's list are read from or checked against these declarations.
A message built in Python (a client's, the gateway's) is checked by ``validate()``: the same decoder the
receiver runs, on the message's own encoding. How messages are framed is ``mpserve.wire.framing``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Annotated, Any, ClassVar, TypeVar

import msgspec
from msgspec import Meta

from mpserve import structured
from mpserve.errors import BadRequest, MpserveError, ProtocolError
from mpserve.wire import media, refusals
from mpserve.wire.figures import ModelStats, TenantStats
from mpserve.wire.prefix import MAX_BLOCKS

WORKER_LINK = "MPS1.5"  # the revision of the broker-worker messages, in every READY: a broker refuses workers
# of another but PREVIOUS_LINK (1.1: STEP replaced the worker's CHUNKS, and ASSIGNS came; 1.2: LoRA adapters: READY's,
# ADAPTER_ACTION; ASSIGN's salt; PREEMPT and PARKED; 1.3: adoption: READY's live requests, HEARTBEAT's pid,
# HAND_OFF; 1.4: READY's version and engine; 1.5: LIVE's answered), so a remote pool is upgraded with it
PREVIOUS_LINK = "MPS1.4"  # a revision whose workers a broker of this one still takes: its messages are this one's
# but for fields this one added with a default; an upgrade's adopted instances of it serve until a roll replaces
# them (``mpserve.server.rolling``)
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_CACHE_ITEMS = 4096  # entries per list in a CACHE frame
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
MAX_TIMEOUT_S = 7 * 24 * 3600
CONTROL_OPS = ("models", "load", "unload", "scale", "add", "reload")
MAX_INSTANCES = 256
SLOT_ACTIONS = ("save", "restore", "erase")
MAX_FILENAME_CHARS = 128
MAX_ADAPTERS = 8  # LoRA adapters one request may choose
MAX_LOADED_ADAPTERS = 256  # LoRA adapters one instance reports loaded
ADAPTER_OPS = ("load", "unload")
MAX_ADAPTER_SCALE = 4.0  # the largest scale magnitude of one (llama-server takes any; past this, output is noise)
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # no ':' (``model: BASE:NAME``), no '/', no spaces
MAX_CACHE_SALT_CHARS = 256  # vLLM's cache_salt
MAX_TENANT_CHARS = 64
MAX_SALT_BYTES = 32
MAX_TRACEPARENT_CHARS = 55  # W3C trace context, version 00


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
    ADAPTER_REPLY = 0x1A
    READY = 0x20
    HEARTBEAT = 0x21
    FAILED = 0x22
    UNLOADED = 0x23
    STEP = 0x24
    LEAVING = 0x25
    PARKED = 0x26
    ASSIGN = 0x30
    STOP = 0x31
    UNLOAD = 0x32
    ASSIGNS = 0x33
    ADAPTER_ACTION = 0x34
    PREEMPT = 0x35
    HAND_OFF = 0x36


# --- the field types that recur -----------------------------------------------------------------

Id = Annotated[str, Meta(max_length=MAX_ID_CHARS)]
Name = Annotated[str, Meta(max_length=256)]  # a model's name, a host's, a reason
Ticket = Annotated[str, Meta(max_length=MAX_ID_CHARS)]
Text = Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)]
Timeout = Annotated[float, Meta(ge=0.001, le=MAX_TIMEOUT_S)]
Choice = Annotated[int, Meta(ge=0, le=MAX_CHOICES - 1)]
Message = Annotated[str, Meta(max_length=64 * 1024)]
Packed = bytes  # int32 little-endian token ids (pack_tokens), or another packed column
AdapterName = Annotated[str, Meta(pattern=ADAPTER_NAME_PATTERN, description="a LoRA adapter's name")]
AdapterScale = Annotated[float, Meta(ge=-MAX_ADAPTER_SCALE, le=MAX_ADAPTER_SCALE, description="its scale")]

M = TypeVar("M", bound="Body")


class Body(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What every body has: the rules across its fields (``check``), and how one built in Python is checked."""

    REFUSED_AS: ClassVar[type[MpserveError]] = ProtocolError  # BadRequest: a client's parameters (not its id)

    def check(self) -> None:
        """The rules a well-typed body must still meet: the ones across fields, or that types cannot state."""

    def validate(self) -> None:
        """Refuse this message as its receiver would (types and limits included, for one built in Python)."""
        decode_as(type(self), pack(self))


_ENCODER = msgspec.msgpack.Encoder()


def pack(msg: Any) -> bytes:
    """A body: a message (nested ones included) as the map of its fields, or plain data, encoded in C."""
    return _ENCODER.encode(msg)


def decode_as(kind: type[M], body: bytes | memoryview) -> M:
    """``body`` decoded as ``kind`` and checked: the message, or the error that names the problem."""
    msg: M = refusals.decode(decoder(kind), body)
    msg.check()
    return msg


_DECODERS: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


def decoder(kind: Any) -> msgspec.msgpack.Decoder[Any]:
    """The typed decoder of ``kind``, made once."""
    typed = _DECODERS.get(kind)
    if typed is None:
        typed = _DECODERS[kind] = msgspec.msgpack.Decoder(kind)
    return typed


# --- sampling -----------------------------------------------------------------------------------

def _param(low: float, high: float, meaning: str) -> Meta:
    return Meta(ge=low, le=high, description=meaning)


Bias = tuple[Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)], Annotated[float, Meta(ge=-100.0, le=100.0)]]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
REASONING_EFFORTS = ("low", "medium", "high")
MAX_REASONING_TAG_CHARS = 64


class GenerateParams(Body, frozen=True, forbid_unknown_fields=True):
    """Sampling parameters, as llama.cpp takes them (``mpserve.engine.sampling``). This class is their one
    declaration: the name, type, limits, default and meaning of each."""

    REFUSED_AS: ClassVar[type[MpserveError]] = BadRequest
    FIELD_WORD: ClassVar[str] = "parameter"
    max_tokens: Annotated[int, _param(1, MAX_TOKENS_LIMIT, "most tokens generated")] = 128
    temperature: Annotated[float, _param(0.0, 100.0, "0: greedy")] = 0.8
    top_p: Annotated[float, _param(0.0, 1.0, "nucleus sampling: the most probable tokens up to this mass")] = 0.95
    top_k: Annotated[int, _param(0, 1 << 20, "only the k most probable tokens (0: all)")] = 40
    seed: Annotated[int, _param(0, 2**32 - 1, "the draw's seed; nil: a random one")] | None = None
    stop: Annotated[tuple[StopString, ...], Meta(max_length=MAX_STOP_STRINGS,
                                           description="strings that end the completion (left out of it)")] = ()
    repeat_penalty: Annotated[float, _param(0.01, 100.0, "penalty of recently seen tokens (1: none)")] = 1.0
    presence_penalty: Annotated[float, _param(-2.0, 2.0, "penalty of tokens already generated")] = 0.0
    frequency_penalty: Annotated[float, _param(-2.0, 2.0, "penalty by how often a token was generated")] = 0.0
    logit_bias: Annotated[tuple[Bias, ...], Meta(
        max_length=MAX_LOGIT_BIAS, description="[token id, bias] pairs: the bias is added to the token's logit")] = ()
    min_p: Annotated[float, _param(0.0, 1.0, "tokens less probable than this share of the top one are dropped")] = 0.05
    typical_p: Annotated[float, _param(0.0, 1.0, "locally typical sampling (1: off)")] = 1.0
    ignore_eos: Annotated[bool, Meta(description="end-of-generation tokens are never sampled")] = False
    logprobs: Annotated[int, _param(0, MAX_TOP_LOGPROBS, "report each generated token's log-probability and the N "
                                                         "most probable")] | None = None
    grammar: Annotated[str, Meta(max_length=structured.MAX_GRAMMAR_CHARS,
                                 description="GBNF text the output follows; not with json_schema")] | None = None
    json_schema: Annotated[str, Meta(max_length=structured.MAX_SCHEMA_CHARS,
                                     description="a JSON Schema, as canonical JSON text, the output follows; not "
                                                 "with grammar")] | None = None
    prompt_logprobs: Annotated[bool, Meta(description="with logprobs: the prompt's tokens' too, first")] = False
    n: Annotated[int, _param(1, MAX_CHOICES, "choices, choice i seeded with seed + i")] = 1
    speculative_n_max: Annotated[int, _param(0, 64, "most tokens drafted a step for this request (0: none); nil: "
                                                    "the model's setting")] | None = None
    reasoning_end: Annotated[str, Meta(min_length=1, max_length=MAX_REASONING_TAG_CHARS, description=(
        "the tag that ends the thinking the prompt opened: the reply thinks first, within reasoning_budget, then "
        "answers, its grammar or json_schema applying from the tag on; nil: no thinking"))] | None = None
    reasoning_budget: Annotated[int, _param(-1, MAX_TOKENS_LIMIT, "most tokens the thinking takes before its end "
                                                                  "tag is forced (-1: no limit); nil: the model's "
                                                                  "budget for reasoning_effort")] | None = None
    reasoning_effort: Annotated[str, Meta(max_length=8, description="low, medium or high: the model's budget for "
                                                                    "it when reasoning_budget is nil; nil: medium")
                                ] | None = None

    @classmethod
    def from_wire(cls, values: dict[str, Any]) -> GenerateParams:
        """The parameters of plain values (a parsed JSON object): ``logit_bias`` may be OpenAI's map."""
        if not isinstance(values, dict):
            raise BadRequest("'params' must be a map")
        if "logit_bias" in values:
            values = {**values, "logit_bias": logit_bias_pairs(values["logit_bias"])}
        params: GenerateParams = refusals.convert(values, cls)
        params.validate()
        return params

    def validate(self) -> None:
        """BadRequest naming the first parameter out of its range. Parameters seen valid lately pass at once
        (a frozen value is valid or not for good; clients tend to send the same ones)."""
        try:
            if self in _VALID:
                return
        except TypeError:  # a list where a tuple goes (made by hand, not decoded): checked every time
            super().validate()
            return
        super().validate()
        if len(_VALID) >= _VALID_KEPT:
            _VALID.clear()
        _VALID.add(self)

    def check(self) -> None:
        if self.prompt_logprobs and self.logprobs is None:
            raise BadRequest("'prompt_logprobs' needs 'logprobs' (the number of top tokens to report, 0..20)")
        if self.grammar is not None and self.json_schema is not None:
            raise BadRequest("give 'grammar' or 'json_schema', not both")
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            raise BadRequest(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got "
                             f"{self.reasoning_effort!r}")
        if self.grammar is not None:
            structured.check_grammar(self.grammar)
        if self.json_schema is not None:
            structured.check_schema(self.json_schema)  # its size and shape: the worker compiles it

    def choice_params(self, index: int) -> GenerateParams:
        """Choice ``index``'s parameters: one choice, seeded with seed + index (modulo 2**32) when seeded."""
        seed = None if self.seed is None else (self.seed + index) % 2**32
        return msgspec.structs.replace(self, n=1, seed=seed)


SAMPLING = GenerateParams.__struct_fields__  # the sampling parameters' names, in their declared order
_VALID: set[GenerateParams] = set()
_VALID_KEPT = 1024


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


# --- packed columns -----------------------------------------------------------------------------

def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as they travel: int32, little-endian (a msgpack list would cost a byte or more per id)."""
    try:
        return struct.pack(f"<{len(tokens)}i", *tokens)
    except struct.error:
        raise BadRequest(f"token ids must be integers from 0 to {MAX_TOKEN_ID}") from None


def unpack_tokens(data: bytes, key: str = "tokens") -> list[int]:
    if len(data) % 4:
        raise ProtocolError(f"field '{key}' must hold int32 token ids, got {len(data)} bytes")
    return list(struct.unpack(f"<{len(data) // 4}i", data))


def pack_hashes(hashes: Sequence[int]) -> bytes:
    """Block hashes as a CACHE entry carries them: uint64, little-endian."""
    return struct.pack(f"<{len(hashes)}Q", *hashes)


def unpack_hashes(data: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(data) // 8}Q", data)


# --- client -> broker ---------------------------------------------------------------------------

class Request(Body, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """client -> broker: generate a completion. ``timeout`` (seconds) covers queueing and running. Fields at their
    default are left out of its encoding, so a request without images is what a peer from before them decodes."""

    TYPE: ClassVar[MsgType] = MsgType.REQUEST
    REFUSED_AS: ClassVar[type[MpserveError]] = BadRequest
    id: Id
    prompt: Text
    model: Name | None = None
    params: GenerateParams = msgspec.field(default_factory=GenerateParams)
    stream: bool = False
    timeout: Timeout | None = None
    tokens: Annotated[Packed, Meta(max_length=4 * MAX_PROMPT_CHARS)] = b""  # a prompt of token ids, taken as it
    # is, instead of ``prompt``
    adapters: Annotated[tuple[tuple[AdapterName, AdapterScale], ...], Meta(max_length=MAX_ADAPTERS)] = ()  # LoRA
    # adapters (names the model serves) and scales; (): the base model
    priority: Annotated[int, Meta(ge=-100, le=100)] = 0  # higher is more urgent: queued ahead of lower ones, and
    # may preempt a running one of lower priority (``mpserve.server.preemption``); capped by the tenant's max_priority
    cache_salt: Annotated[str, Meta(max_length=MAX_CACHE_SALT_CHARS)] | None = None  # shares reuse with the
    # requests naming the same (``mpserve.wire.salt``); None: the tenant's own
    tenant: Annotated[str, Meta(max_length=MAX_TENANT_CHARS)] = ""  # honoured on the admin socket only (the
    # gateway's); on the clients' socket the broker takes it from the connection (a CURVE client's key; "" for the
    # local user)
    images: Annotated[tuple[Annotated[bytes, Meta(max_length=media.MAX_IMAGE_BYTES)], ...], Meta(
        max_length=media.MAX_IMAGES)] = ()  # encoded images and audio clips (``wire.audio``), each at the next marker
    reattach: bool = False  # sent again after the server went silent: a server that took over this request (its
    # instance outlived the one that died, ``mpserve.server.adoption``) goes on with it, streaming its whole text so
    # far first; any other runs it anew. Either way the client drops the text it had (``mpserve.client``)
    traceparent: Annotated[str, Meta(max_length=MAX_TRACEPARENT_CHARS)] = ""  # the W3C trace context its spans
    # continue (``mpserve.tracing``); "" for none, and one that is not W3C's format starts a new trace

    def check(self) -> None:
        self.params.check()  # decoded: its types and limits were checked already
        if any(t < 0 for t in unpack_tokens(self.tokens)):
            raise BadRequest("prompt token ids must be >= 0")
        names = [name for name, _ in self.adapters]
        if len(set(names)) != len(names):
            raise BadRequest(f"'adapters' names an adapter twice ({', '.join(names)}); give each once, with its scale")


class Cancel(Body, frozen=True, forbid_unknown_fields=True):
    """client -> broker, broker -> worker: stop request ``id`` (a client's id, or a worker's ticket)."""

    TYPE: ClassVar[MsgType] = MsgType.CANCEL
    id: Id


class Ping(Body, frozen=True, forbid_unknown_fields=True):
    """client -> broker: liveness probe; answered by PONG. Any traffic counts as liveness."""

    TYPE: ClassVar[MsgType] = MsgType.PING
    nonce: int = 0


class StatsQuery(Body, frozen=True, forbid_unknown_fields=True):
    """client -> broker: ask for the broker's counters (for monitoring, e.g. the HTTP gateway)."""

    TYPE: ClassVar[MsgType] = MsgType.STATS_QUERY
    nonce: int = 0


class Control(Body, frozen=True, forbid_unknown_fields=True):
    """client -> broker: an operator's call, answered by CONTROL_REPLY or ERROR with the same ``id``.

    ``models`` lists the models; ``load`` starts a model's instances (min at least 1); ``unload`` drains them
    all (min 0: the next request loads it again); ``scale`` sets ``min`` and/or ``max``; ``add`` serves the GGUF
    at ``path`` as a new model (``model`` names it; the file's stem if None) with ``min`` (1) .. ``max``;
    ``reload`` reads the server's configuration again and applies what changed (``mpserve.server.reload``)."""

    TYPE: ClassVar[MsgType] = MsgType.CONTROL
    REFUSED_AS: ClassVar[type[MpserveError]] = BadRequest
    id: Id
    op: Annotated[str, Meta(max_length=16)]
    model: Name | None = None
    min: Annotated[int, Meta(ge=0, le=MAX_INSTANCES)] | None = None
    max: Annotated[int, Meta(ge=1, le=MAX_INSTANCES)] | None = None
    path: Annotated[str, Meta(max_length=4096)] | None = None

    def check(self) -> None:
        if self.op not in CONTROL_OPS:
            raise BadRequest(f"'op' must be one of {', '.join(CONTROL_OPS)}, got {self.op!r}")
        if self.op not in ("models", "add", "reload") and self.model is None:
            raise BadRequest(f"'model' is needed for {self.op}")
        if (self.op == "add") != (self.path is not None):
            raise BadRequest("'path' is needed for add" if self.op == "add" else f"'path' is for add, not {self.op}")
        if self.op == "scale" and self.min is None and self.max is None:
            raise BadRequest("scale needs 'min', 'max' or both")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise BadRequest(f"'min' ({self.min}) is above 'max' ({self.max})")


class Tokenize(Body, frozen=True, forbid_unknown_fields=True):
    """client -> broker -> worker: ``text`` to tokens with the vocabulary of ``model`` (``add_special``: the
    model's BOS too; specials written in the text are parsed), or, with ``detokenize``, ``tokens`` to text.
    The broker sends it to a loaded instance of the model, with ``ticket`` set; answered by TOKENS or ERROR."""

    TYPE: ClassVar[MsgType] = MsgType.TOKENIZE
    REFUSED_AS: ClassVar[type[MpserveError]] = BadRequest
    id: Id
    model: Name | None = None
    text: Text = ""
    tokens: Annotated[Packed, Meta(max_length=4 * MAX_PROMPT_CHARS)] = b""
    detokenize: bool = False
    add_special: bool = False
    with_pieces: bool = False
    timeout: Timeout | None = None
    ticket: Ticket = ""

    def check(self) -> None:
        unpack_tokens(self.tokens)


class Embed(Body, frozen=True, forbid_unknown_fields=True):
    """client -> broker -> worker: the embeddings of ``texts``, or of ``tokens`` (one pack_tokens per input),
    by the embedding model ``model``; with ``query``, a reranker's score of each text against it (EMBEDDINGS of
    one number each). The broker sends it to the least busy loaded instance of the model, with
    ``ticket`` set, as it sends TOKENIZE; answered by EMBEDDINGS or ERROR."""

    TYPE: ClassVar[MsgType] = MsgType.EMBED
    REFUSED_AS: ClassVar[type[MpserveError]] = BadRequest
    id: Id
    model: Name | None = None
    texts: Annotated[tuple[Annotated[str, Meta(min_length=1, max_length=MAX_PROMPT_CHARS)], ...],
                     Meta(max_length=MAX_EMBED_INPUTS)] = ()
    tokens: Annotated[tuple[Annotated[Packed, Meta(min_length=1)], ...], Meta(max_length=MAX_EMBED_INPUTS)] = ()
    timeout: Timeout | None = None
    ticket: Ticket = ""
    query: Text | None = None  # a rerank: the texts are documents, each scored against this query

    def check(self) -> None:
        if bool(self.texts) == bool(self.tokens):
            raise BadRequest("'input' must be texts or token arrays, not empty")
        if len(self.texts) + len(self.tokens) > MAX_EMBED_INPUTS:
            raise BadRequest(f"'input' may hold at most {MAX_EMBED_INPUTS} inputs, got "
                             f"{len(self.texts) + len(self.tokens)}")
        if any(i < 0 for t in self.tokens for i in unpack_tokens(t, "input")):
            raise BadRequest("each 'input' token array must be a non-empty list of token ids >= 0")
        if self.query is not None and (self.tokens or not self.query):
            raise BadRequest("a rerank takes a non-empty 'query' and documents as texts")


class SlotAction(Body, frozen=True, forbid_unknown_fields=True):
    """client -> broker -> worker: ``save`` slot ``slot`` of instance ``worker`` (its identity: w0, w1, ...) to
    ``filename`` in the model's ``slot_save_path``, ``restore`` it from there, or ``erase`` its cells. The broker
    sends it to that worker with ``ticket`` set; answered by SLOT_REPLY or ERROR."""

    TYPE: ClassVar[MsgType] = MsgType.SLOT_ACTION
    REFUSED_AS: ClassVar[type[MpserveError]] = BadRequest
    id: Id
    worker: Annotated[str, Meta(max_length=MAX_ID_CHARS)]
    slot: Annotated[int, Meta(ge=0, le=1023)]
    action: Annotated[str, Meta(max_length=16)]
    filename: Annotated[str, Meta(max_length=MAX_FILENAME_CHARS)] = ""
    ticket: Ticket = ""

    def check(self) -> None:
        if self.action not in SLOT_ACTIONS:
            raise BadRequest(f"'action' must be one of {', '.join(SLOT_ACTIONS)}, got {self.action!r}")
        if self.action != "erase" and not self.filename:
            raise BadRequest(f"{self.action} needs a 'filename'")


# --- broker -> client ---------------------------------------------------------------------------

class ChatTemplate(msgspec.Struct, frozen=True):
    """A model's chat template as it travels: read by the worker that loads the model (READY), kept by the
    broker per model (STATS), rendered by the gateway (``mpserve.gateway.api.chat``)."""

    template: str = ""  # Jinja2 source; "" when the model has none
    bos_token: str = ""
    eos_token: str = ""

    def __bool__(self) -> bool:
        return bool(self.template)


class Pong(Body, frozen=True, forbid_unknown_fields=True):
    TYPE: ClassVar[MsgType] = MsgType.PONG
    nonce: int = 0
    models: tuple[str, ...] = ()
    max_message_bytes: int = 0  # the largest message BODY the server takes; 0 (an older server): MAX_MESSAGE_BYTES
    server: Annotated[str, Meta(max_length=64)] = ""  # this start of the server: another one after a restart (the
    # requests sent before it are sent again, ``mpserve.client``); "" from an older server


class WorkerStats(Body, frozen=True, forbid_unknown_fields=True):
    worker: str
    model: str
    host: str  # "" for this host's own workers
    pid: int
    device: int
    capacity: int
    running: int


class Stats(Body, frozen=True, forbid_unknown_fields=True):
    """broker -> client: counters since start (accepted, done, timeout, retried, ... by name), and the
    state of each model's queue."""

    TYPE: ClassVar[MsgType] = MsgType.STATS
    nonce: int
    accepting: bool
    counters: dict[str, int]
    models: dict[str, ModelStats]
    workers: list[WorkerStats] = msgspec.field(default_factory=list)
    tenants: dict[str, TenantStats] = msgspec.field(default_factory=dict)  # the busiest by name, then "other"


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


class ControlReply(Body, frozen=True, forbid_unknown_fields=True):
    """broker -> client: what a CONTROL call did (``message``) and every model after it."""

    TYPE: ClassVar[MsgType] = MsgType.CONTROL_REPLY
    id: Id
    message: Annotated[str, Meta(max_length=4096)]
    models: list[ModelControl] = msgspec.field(default_factory=list)


class Logprobs(Body, frozen=True, forbid_unknown_fields=True):
    """Log-probabilities of generated tokens (log-softmax of the raw logits, before any sampler), in columns
    of packed numbers: a completion can have more tokens than a msgpack list should hold. For each sampled
    token: its id and log-probability, and the ``top`` most probable tokens, most probable first; ``pieces``
    holds each sampled token's bytes followed by its top tokens' bytes, ending at the offsets ``piece_ends``.

    Asked for with ``prompt_logprobs``, the first ``prompt`` entries are the prompt's tokens (a leading BOS is
    left out: its text is no part of the prompt), each scored given the tokens before it; a first token that
    nothing precedes has log-probability NaN and top entries of id -1, no bytes and NaN."""

    top: int = 0
    tokens: Packed = b""  # int32 (pack_tokens)
    logprobs: bytes = b""  # float64, little-endian
    top_tokens: Packed = b""  # int32, ``top`` per sampled token
    top_logprobs: bytes = b""  # float64
    pieces: bytes = b""
    piece_ends: Packed = b""  # int32
    prompt: Annotated[int, Meta(ge=0)] = 0  # leading entries that are prompt tokens

    def check(self) -> None:
        n = len(self.tokens) // 4
        if self.prompt > n:
            raise ProtocolError(f"field 'prompt' of 'logprobs' must be 0..{n}, got {self.prompt}")
        if (len(self.tokens) != 4 * n or len(self.logprobs) != 8 * n or len(self.top_tokens) != 4 * n * self.top
                or len(self.top_logprobs) != 8 * n * self.top or len(self.piece_ends) != 4 * n * (1 + self.top)):
            raise ProtocolError("the columns of 'logprobs' do not have matching lengths")

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


class Chunk(Body, frozen=True, forbid_unknown_fields=True):
    """A piece of streamed text for request ``id`` (with the log-probabilities of its tokens, if asked)."""

    TYPE: ClassVar[MsgType] = MsgType.CHUNK
    id: Id
    text: Text
    logprobs: Logprobs | None = None
    index: Choice = 0  # the choice, of a request for n

    def check(self) -> None:
        if self.logprobs is not None:
            self.logprobs.check()


class Chunks(msgspec.Struct, frozen=True):
    """Several CHUNKs in one message (of different requests, or of one), in the order they were made."""

    TYPE: ClassVar[MsgType] = MsgType.CHUNKS
    chunks: tuple[Chunk, ...]


class Usage(Body, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A completion's tokens. Fields at their default are left out of the body, so a reply without thinking is
    what a client from before ``reasoning_tokens`` decodes."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: Annotated[int, Meta(description="of the completion's tokens, those of its thinking, its end "
                                                      "tag included")] = 0

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


class Done(Body, frozen=True, forbid_unknown_fields=True):
    """Terminal success for request ``id``. ``text`` is the whole completion, streamed or not.
    ``finish_reason``: "length" (max_tokens reached), "stop" (end of text or a stop string)."""

    TYPE: ClassVar[MsgType] = MsgType.DONE
    id: Id
    text: Annotated[str, Meta(max_length=4 * MAX_PROMPT_CHARS)]
    finish_reason: Annotated[str, Meta(max_length=32)]
    usage: Usage
    timings: Timings
    worker: Annotated[str, Meta(max_length=64)] = ""
    logprobs: Logprobs | None = None  # streamed: those of tokens no CHUNK carried
    index: Choice = 0  # the choice: a request for n gets n DONEs, one per choice

    def check(self) -> None:
        if self.logprobs is not None:
            self.logprobs.check()


class Error(Body, frozen=True, forbid_unknown_fields=True):
    """Terminal failure for request ``id`` (None when the failing message carried no usable id).
    ``code`` is one of the stable codes in ``mpserve.errors``."""

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    id: Id | None
    code: Annotated[str, Meta(max_length=64)]
    message: Message
    retry_after: float | None = None


class Tokens(Body, frozen=True, forbid_unknown_fields=True):
    """worker -> broker -> client: the answer to TOKENIZE ``id``: ``tokens`` (pack_tokens) and ``text``; with
    ``with_pieces``, each token's bytes, concatenated in ``pieces``, ending at the offsets ``piece_ends``."""

    TYPE: ClassVar[MsgType] = MsgType.TOKENS
    id: Id
    tokens: Packed = b""
    text: Annotated[str, Meta(max_length=4 * MAX_PROMPT_CHARS)] = ""
    pieces: bytes = b""
    piece_ends: Packed = b""  # pack_tokens of the offsets

    def check(self) -> None:
        unpack_tokens(self.tokens)
        unpack_tokens(self.piece_ends, "piece_ends")


class Embeddings(Body, frozen=True, forbid_unknown_fields=True):
    """worker -> broker -> client: the answer to EMBED ``id``: one L2-normalised vector of ``dim`` float32
    (little-endian) per input, in order, concatenated in ``vectors``; ``prompt_tokens``: the inputs' tokens."""

    TYPE: ClassVar[MsgType] = MsgType.EMBEDDINGS
    id: Id
    dim: int
    vectors: bytes
    prompt_tokens: int = 0

    def check(self) -> None:
        if self.dim < 1 or len(self.vectors) % (4 * self.dim):
            raise ProtocolError(f"field 'vectors' must hold float32 vectors of {self.dim}, got {len(self.vectors)} "
                                f"bytes")

    def rows(self) -> list[list[float]]:
        n = len(self.vectors) // (4 * self.dim)
        flat = struct.unpack(f"<{n * self.dim}f", self.vectors)
        return [list(flat[i * self.dim:(i + 1) * self.dim]) for i in range(n)]


class SlotReply(Body, frozen=True, forbid_unknown_fields=True):
    """worker -> broker -> client: what SLOT_ACTION ``id`` did: the tokens saved, restored or erased, the file's
    bytes (save, restore) and the milliseconds it took."""

    TYPE: ClassVar[MsgType] = MsgType.SLOT_REPLY
    id: Id
    action: Annotated[str, Meta(max_length=16)]
    tokens: int
    bytes: int = 0
    ms: float = 0.0


# --- broker <-> worker --------------------------------------------------------------------------

class Ready(Body, frozen=True, forbid_unknown_fields=True):
    """worker -> broker: able to take ``capacity`` requests at once. ``loaded`` False: the model is not in
    memory yet (single active backend) and will be loaded by the first request."""

    TYPE: ClassVar[MsgType] = MsgType.READY
    worker: Id
    model: Name
    device: int
    capacity: int
    pid: int
    loaded: bool = True
    host: Name = ""  # set by workers of remote pools
    protocol: Annotated[str, Meta(max_length=16)] = WORKER_LINK
    version: Name = ""  # the worker's mpserve version ("" from a worker of PREVIOUS_LINK)
    engine: Annotated[str, Meta(max_length=64)] = ""  # a digest of the settings it runs (``EngineSpec.digest``)
    chat_template: Annotated[str, Meta(max_length=MAX_TEMPLATE_CHARS)] = ""  # the model's chat template (Jinja2,
    # from its GGUF; "" if none or not loaded)
    bos_token: Name = ""
    eos_token: Name = ""
    proof: Annotated[str, Meta(max_length=64)] = ""  # the broker's per-start secret, from its own workers only
    # (mpserve.server.link)
    adapters: Annotated[tuple[AdapterName, ...], Meta(max_length=MAX_LOADED_ADAPTERS)] = ()  # the LoRA adapters
    # loaded (the requests it can take: ``Request.adapters`` of these names); the slot table shows each slot's
    live: tuple[Live, ...] = ()  # an instance whose server died: the requests it holds parked, for the server that
    # adopts it (``mpserve.server.adoption``)

    def check(self) -> None:
        for one in self.live:
            one.check()


class Heartbeat(Body, frozen=True, forbid_unknown_fields=True):
    """Both ways between broker and workers, every heartbeat interval (any other traffic counts too).
    From the broker, ``registered`` False tells a worker the broker does not know it (it was declared
    lost, or the broker restarted): the worker registers again with READY."""

    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    worker: Id
    registered: bool = True
    pid: int = 0  # from a broker: its server's process, which a local worker watches (0 from a worker)


class Failed(Body, frozen=True, forbid_unknown_fields=True):
    """worker -> broker: the model could not be loaded; the worker exits after sending this. A local worker
    sends it before its READY, so it carries the same ``proof`` (``mpserve.server.link``)."""

    TYPE: ClassVar[MsgType] = MsgType.FAILED
    worker: Annotated[str, Meta(max_length=64)]
    model: Name
    message: Message
    proof: Annotated[str, Meta(max_length=64)] = ""


class Unloaded(Body, frozen=True, forbid_unknown_fields=True):
    """worker -> broker: the model is out of memory (after UNLOAD, or the idle watchdog)."""

    TYPE: ClassVar[MsgType] = MsgType.UNLOADED
    worker: Annotated[str, Meta(max_length=64)]


class Leaving(Body, frozen=True, forbid_unknown_fields=True):
    """worker -> broker: this worker is exiting (told to stop, terminated, or the server or pool that started it
    is gone), now: the broker forgets it at once and hands over the requests it ran, which it does not answer."""

    TYPE: ClassVar[MsgType] = MsgType.LEAVING
    worker: Annotated[str, Meta(max_length=64)]
    reason: Name = ""


class Unload(Body, frozen=True, forbid_unknown_fields=True):
    """broker -> worker: free the model (single active backend: another model gets the device)."""

    TYPE: ClassVar[MsgType] = MsgType.UNLOAD
    reason: Name = ""


class HandOff(Body, frozen=True, forbid_unknown_fields=True):
    """broker -> worker: the server hands its instances to its next start (an upgrade: ``mpserve upgrade``): park
    what runs and offer it to the next broker, as when the server dies (``mpserve.server.adoption``), answering this
    broker with READY and its LIVE requests first."""

    TYPE: ClassVar[MsgType] = MsgType.HAND_OFF
    reason: Name = ""


class Stop(Body, frozen=True, forbid_unknown_fields=True):
    """broker -> worker: finish nothing new and exit."""

    TYPE: ClassVar[MsgType] = MsgType.STOP
    reason: Name = ""


class Assign(Body, frozen=True, forbid_unknown_fields=True):
    """broker -> worker: run ``request``; echo ``ticket`` on every CHUNK/DONE/ERROR for it."""

    TYPE: ClassVar[MsgType] = MsgType.ASSIGN
    ticket: Ticket
    request: Request
    queue_ms: float
    attempt: int
    slot: int = 0  # which of the worker's slots: the broker picks the one whose cache fits the prompt
    report_tokens: bool = False  # send each CHUNK's token ids (a TOKENS frame), so it can be resumed elsewhere
    generated: Annotated[Packed, Meta(max_length=4 * MAX_TOKENS_LIMIT)] = b""  # resuming: the tokens the lost
    # instance streamed (a TOKENS frame's encoding)
    index: Choice = 0  # the choice this assignment is, of a request for n (its request asks for one)
    salt: Annotated[bytes, Meta(max_length=MAX_SALT_BYTES)] = b""  # its reuse namespace (``mpserve.wire.salt``):
    # the cells and store entries it may start from are those computed under the same salt

    def check(self) -> None:
        """Its request's rules first, then its own."""
        self.request.check()
        if len(self.generated) % 4:
            raise ProtocolError(f"field 'generated' must be int32 token ids, at most {MAX_TOKENS_LIMIT}")


class Live(Body, frozen=True, forbid_unknown_fields=True):
    """In an adopted worker's READY: a request it ran when its server died, parked since, or ``answered`` just before
    (an ASSIGN of it answers it again: ``mpserve.worker.offers``): its ASSIGN, the ``text`` it streamed (whole: the dead
    broker may have dropped some), its token ids (``Assign.generated``'s encoding), to resume it there or elsewhere."""

    assign: Assign
    text: Annotated[str, Meta(max_length=4 * MAX_PROMPT_CHARS)] = ""
    generated: Annotated[Packed, Meta(max_length=4 * MAX_TOKENS_LIMIT)] = b""
    answered: bool = False  # it ended just before the death (DONE or ERROR sent): an ASSIGN of it is answered again

    def check(self) -> None:
        self.assign.check()
        if len(self.generated) % 4:
            raise ProtocolError(f"field 'generated' must be int32 token ids, at most {MAX_TOKENS_LIMIT}")


class Preempt(Body, frozen=True, forbid_unknown_fields=True):
    """broker -> worker: park the sequence of ASSIGN ``ticket`` and free its slot (``mpserve.server.preemption``).
    The worker answers PARKED under that ticket, or nothing if the request ended first (its DONE or ERROR says
    so). A later ASSIGN with the same ticket resumes the parked sequence; a CANCEL of it forgets it."""

    TYPE: ClassVar[MsgType] = MsgType.PREEMPT
    ticket: Ticket


class Parked(Body, frozen=True, forbid_unknown_fields=True):
    """worker -> broker, under the TICKET of an ASSIGN: request ``id`` was parked after its CHUNKs so far; its slot
    is free. A TOKENS frame may follow with the ids it generated since its last CHUNK (text still held back)."""

    TYPE: ClassVar[MsgType] = MsgType.PARKED
    id: Id


class Assigns(msgspec.Struct, frozen=True):
    """Several ASSIGNs for one worker in one message, in the order the broker made them."""

    TYPE: ClassVar[MsgType] = MsgType.ASSIGNS
    assigns: tuple[Assign, ...]


class AdapterAction(Body, frozen=True, forbid_unknown_fields=True):
    """(client ->) broker -> worker: ``load`` LoRA adapter ``name`` of ``model`` from ``path`` (a GGUF on the
    worker's host, checked against its model), or ``unload`` it (refused while a request runs under it: the broker
    stops assigning it and waits for them first). The broker sends it to an instance with ``ticket`` set; each
    answers ADAPTER_REPLY or ERROR."""

    TYPE: ClassVar[MsgType] = MsgType.ADAPTER_ACTION
    REFUSED_AS: ClassVar[type[MpserveError]] = BadRequest
    id: Id
    op: Annotated[str, Meta(max_length=16)]
    name: AdapterName
    model: Name | None = None
    path: Annotated[str, Meta(max_length=4096)] = ""
    ticket: Ticket = ""

    def check(self) -> None:
        if self.op not in ADAPTER_OPS:
            raise BadRequest(f"'op' must be one of {', '.join(ADAPTER_OPS)}, got {self.op!r}")
        if (self.op == "load") != bool(self.path):
            raise BadRequest("'path' names the adapter file to load: give it with 'load', and only then")


class AdapterReply(Body, frozen=True, forbid_unknown_fields=True):
    """worker -> broker (-> client): what ADAPTER_ACTION ``id`` did on instance ``worker``, the adapters it has
    loaded now, and the milliseconds it took."""

    TYPE: ClassVar[MsgType] = MsgType.ADAPTER_REPLY
    id: Id
    worker: Id
    op: Annotated[str, Meta(max_length=16)]
    name: AdapterName
    adapters: Annotated[tuple[AdapterName, ...], Meta(max_length=MAX_LOADED_ADAPTERS)] = ()
    ms: float = 0.0


CacheId = Annotated[int, Meta(ge=0, le=2**63 - 1)]


class CacheChanges(Body, frozen=True, forbid_unknown_fields=True):
    """worker -> broker, the CACHE frame after a DONE or ERROR: what the instance's host-RAM prompt cache gained
    (``added``: an entry's id and its summary, the block hashes of the prompt text it holds,
    ``mpserve.wire.prefix.block_hashes``, as uint64 little-endian) and lost (``dropped``: ids) since the previous
    CACHE frame. After a READY it is the whole cache (what a broker that restarted learns it from): the most
    recently used entries, up to MAX_CACHE_ITEMS entries and MAX_CACHE_HASHES hashes, nothing dropped. Ids are
    the worker's, unique while its model stays loaded."""

    added: Annotated[tuple[tuple[CacheId, Annotated[bytes, Meta(max_length=8 * MAX_BLOCKS)]], ...],
                     Meta(max_length=MAX_CACHE_ITEMS)] = ()
    dropped: Annotated[tuple[CacheId, ...], Meta(max_length=MAX_CACHE_ITEMS)] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.dropped)

    def check(self) -> None:
        if any(len(hashes) % 8 for _, hashes in self.added):
            raise ProtocolError(f"a CACHE entry must be [id, at most {MAX_BLOCKS} uint64 hashes]")


MESSAGES: tuple[Any, ...] = (Request, Cancel, Ping, StatsQuery, Pong, Stats, Chunk, Done, Error, Ready,
                                    Heartbeat, Failed, Unloaded, Leaving, Assign, Stop, Unload, Tokenize, Tokens,
                                    Control, ControlReply, Embed, Embeddings, SlotAction, SlotReply, AdapterAction,
                                    AdapterReply, Preempt, Parked, HandOff)
"""The message types whose BODY is one map (CHUNKS, ASSIGNS and STEP are arrays: ``mpserve.wire.framing``)."""
