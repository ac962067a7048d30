"""The framing: how the messages of ``mpserve.wire.messages`` travel as ZeroMQ multipart messages.

ROUTER sockets see a routing-identity frame first; that frame belongs to ZeroMQ and is not described here.

    client  -> broker   [VERSION, TYPE, BODY]            REQUEST, CANCEL, PING, STATS_QUERY, TOKENIZE, CONTROL,
                                                         EMBED, SLOT_ACTION
    broker  -> client   [VERSION, TYPE, BODY]            CHUNK, CHUNKS, DONE, ERROR, PONG, STATS, TOKENS,
                                                         CONTROL_REPLY, EMBEDDINGS, SLOT_REPLY
    broker  -> worker   [VERSION, TYPE, BODY]            ASSIGN, ASSIGNS, CANCEL, STOP, UNLOAD, TOKENIZE, EMBED,
                                                         SLOT_ACTION, ADAPTER_ACTION, PREEMPT
    worker  -> broker   [VERSION, TYPE, TICKET, BODY]    READY, HEARTBEAT, FAILED, UNLOADED, LEAVING (empty TICKET);
                                                         CHUNK, DONE, ERROR, PARKED (TICKET of an ASSIGN);
                                                         TOKENS, ERROR (TICKET of a TOKENIZE);
                                                         EMBEDDINGS, ERROR (TICKET of an EMBED);
                                                         SLOT_REPLY, ERROR (TICKET of a SLOT_ACTION);
                                                         ADAPTER_REPLY, ERROR (TICKET of an ADAPTER_ACTION)
                        [VERSION, CHUNK, TICKET, BODY, TOKENS]  when the ASSIGN asked for ``report_tokens``
                        [VERSION, PARKED, TICKET, BODY, TOKENS]  when tokens came since the last CHUNK
                        [VERSION, DONE|ERROR, TICKET, BODY, CACHE]  when the prompt cache changed
                        [VERSION, READY, b"", BODY, CACHE]  when the worker's prompt cache holds entries
                        [VERSION, STEP, b"", BATCH]      the CHUNKs, DONEs and ERRORs of one step, in order

VERSION is ``b"MPS1"``. TYPE is one byte (``MsgType``). BODY is a msgpack map whose schema is the message
class of that type. TICKET is the broker's opaque key for one assignment: a worker echoes it so the broker can
forward the BODY of CHUNK/DONE/ERROR to the client unchanged (the worker writes the client's own request id
into it), without decoding and re-encoding every token. TOKENS is the ids of the tokens generated since the
previous CHUNK, int32 little-endian (``token_frame``): the broker appends them without decoding anything, and
hands them to the next instance if this one is lost (``Assign.generated``), which continues the request from
there. CACHE (``CacheChanges``, a msgpack map) says what the instance's host-RAM prompt cache gained and lost
since its previous CACHE frame; the broker reads it and forwards the BODY as it does without one.

Batches keep the message count from growing with the number of sequences a step or a turn handles (each
message costs a send, a wake-up and a receive in two processes):

- STEP (worker -> broker) carries what one worker step produced for several requests: its BATCH is a
  msgpack array of ``[TYPE, TICKET, BODY, TRAILER or nil]`` (TYPE: CHUNK, DONE, ERROR or PARKED; TRAILER: the
  TOKENS or CACHE frame the message has on its own), in the order the worker made them.
- CHUNKS (broker -> client) carries the CHUNKs of one STEP meant for one client: its BODY is a msgpack
  array of those CHUNK bodies, spliced together unchanged (``splice_array``).
- ASSIGNS (broker -> worker) carries the ASSIGNs one turn of the broker made for one worker: a msgpack
  array of ASSIGN bodies.

A batch of one travels as the plain message (CHUNK, DONE, ERROR, ASSIGN).

Decoding never trusts the sender: a body over MAX_MESSAGE_BYTES is refused unread, and every other is
decoded once, by msgspec, into its class, then checked (``messages.decode_as``); any problem raises
``ProtocolError`` (broken framing, unknown type, bad msgpack) or ``BadRequest`` (a well-formed request with
bad parameters), which the receiver answers or counts.

    frames ─▶ parse_header (count, VERSION, TYPE) ─▶ decode_body ─▶ the message, or the error naming the problem
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import msgspec

from mpserve.errors import ProtocolError
from mpserve.wire import refusals
from mpserve.wire.messages import (
    MAX_ID_CHARS,
    MAX_MESSAGE_BYTES,
    MESSAGES,
    Assign,
    Assigns,
    CacheChanges,
    Chunk,
    Chunks,
    MsgType,
    Usage,
    decoder,
    pack,
)

VERSION = b"MPS1"
TYPE_FRAMES: dict[MsgType, bytes] = {t: bytes([t]) for t in MsgType}
STEPPED = frozenset({MsgType.CHUNK, MsgType.DONE, MsgType.ERROR, MsgType.PARKED})  # what a STEP may carry
_TYPES = {t.value: t for t in MsgType}  # a dict lookup: much cheaper than MsgType(value), once per message
_CLASSES: dict[MsgType, Any] = {cls.TYPE: cls for cls in MESSAGES}
_CLASSES[MsgType.CHUNKS] = tuple[Chunk, ...]
_CLASSES[MsgType.ASSIGNS] = tuple[Assign, ...]
_BATCHES: dict[MsgType, Any] = {MsgType.CHUNKS: Chunks, MsgType.ASSIGNS: Assigns}
_STEP = msgspec.msgpack.Decoder(tuple[tuple[int, str, bytes, bytes | None], ...])


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


def encode_step(entries: Sequence[tuple[MsgType, str, bytes, bytes | None]]) -> list[bytes]:
    """[VERSION, STEP, b"", BATCH]: the (type, ticket, body, trailer or None) of one step, in one message."""
    batch = [[int(mtype), ticket, body, trailer] for mtype, ticket, body, trailer in entries]
    return [VERSION, TYPE_FRAMES[MsgType.STEP], b"", pack(batch)]


def step_entries(batch: bytes) -> list[tuple[MsgType, str, bytes, bytes | None]]:
    """The (type, ticket, body, trailer or None) entries of a worker's STEP, each one checked."""
    _limit(batch)
    try:
        raw = refusals.decode(_STEP, batch)
    except ProtocolError as exc:
        if "body must be" in exc.message or "not valid msgpack" in exc.message:
            raise
        raise ProtocolError("a STEP entry must be [type, ticket, body, trailer or nil]") from None
    entries = []
    for number, ticket, body, trailer in raw:
        mtype = _TYPES.get(number)
        if mtype not in STEPPED:
            raise ProtocolError(f"a STEP carries CHUNK, DONE and ERROR entries, not type {number}")
        entries.append((mtype, ticket, body, trailer))
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


def frame_cache(frame: bytes) -> CacheChanges:
    """A CACHE frame's changes, checked."""
    _limit(frame)
    changes: CacheChanges = refusals.decode(decoder(CacheChanges), frame)
    changes.check()
    return changes


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


def decode_body(mtype: MsgType, body: bytes) -> Any:
    """A message body as its class, decoded once (msgspec: types and limits, in C) and checked."""
    kind = _CLASSES.get(mtype)
    if kind is None:
        raise ProtocolError(f"a {mtype.name} has no body of its own")
    _limit(body)
    msg = refusals.decode(decoder(kind), body)
    batch = _BATCHES.get(mtype)
    for one in msg if batch else (msg,):
        one.check()
    return batch(msg) if batch else msg


def decode(frames: list[bytes]) -> Any:
    """Decode a [VERSION, TYPE, BODY] message (to a client, or to a worker, or from a client)."""
    return decode_body(parse_header(frames, 3), frames[2])


def _limit(body: bytes) -> None:
    if len(body) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message body of {len(body)} bytes is over the limit of {MAX_MESSAGE_BYTES}")


class _Id(msgspec.Struct):
    id: Any = None  # any type: refused below, so that a wrong one is no error


_PEEK = msgspec.msgpack.Decoder(_Id)


def peek_id(body: bytes) -> str | None:
    """The ``id`` of a body that failed validation, so the error can still reach its request (also when
    another field, such as a too long prompt, is what failed)."""
    try:
        rid = _PEEK.decode(body).id
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):  # msgspec's error for deep nesting
        return None
    return rid if isinstance(rid, str) and len(rid) <= MAX_ID_CHARS else None


class _Used(msgspec.Struct):
    usage: Usage


_PEEK_USAGE = msgspec.msgpack.Decoder(_Used)


def peek_usage(body: bytes) -> Usage | None:
    """A DONE body's token counts alone (the broker counts them per tenant and forwards the body as it came);
    None for a body without them."""
    try:
        return _PEEK_USAGE.decode(body).usage
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None
