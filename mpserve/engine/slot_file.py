"""Slot files: one slot's KV cells on disk (``slot_save_path``), so a long conversation survives a restart
(llama-server's ``/slots/{id}?action=save|restore``).

    MAGIC · header length (u32 LE) · header (JSON) · tokens (int32 LE) · state (llama_state_seq_get_data)

The header names what the cells belong to: the model (llama.cpp's description, parameter count and size),
the KV cache types and the number of KV streams (llama.cpp restores a state only into as many). ``read``
refuses, saying which, a file that is not a slot file, one saved from another model, with other KV types or
streams, and one cut short; the state is handed to llama.cpp only when everything matches, so a refused
file leaves the slot as it was.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mpserve.errors import BadRequest
from mpserve.private import PlantedFile, create_private, open_private

MAGIC = b"MPSLOTF1"
_LENGTH = struct.Struct("<I")
MAX_HEADER_BYTES = 64 * 1024


@dataclass(frozen=True)
class Identity:
    """What a slot's cells depend on."""

    model: str  # llama_model_desc, e.g. "llama 85M F16"
    n_params: int
    model_size: int
    cache_type_k: str
    cache_type_v: str
    kv_streams: int  # llama.cpp's state has one KV stream per slot (parallel), or one shared pool (kv_unified)


@dataclass(frozen=True)
class SlotFile:
    identity: Identity
    tokens: list[int]
    whole: int  # of those, the leading ones computed as whole prompt chunks (reusable exactly)
    state: Any  # a ctypes byte array, as llama.cpp reads and writes it
    size: int


def write(path: Path, saved: SlotFile) -> None:
    """Write ``saved`` to ``path`` atomically (a new temporary file in the same folder, 0600, then renamed): a
    conversation's cells are its text."""
    header = json.dumps({**asdict(saved.identity), "n_tokens": len(saved.tokens), "whole": saved.whole,
                         "state_bytes": saved.size}).encode()
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)  # an earlier save's, cut short
    with os.fdopen(create_private(tmp, os.O_WRONLY), "wb") as out:
        out.write(MAGIC + _LENGTH.pack(len(header)) + header)
        out.write(struct.pack(f"<{len(saved.tokens)}i", *saved.tokens))
        out.write(bytes(saved.state)[:saved.size])
    os.replace(tmp, path)


def read(path: Path, expected: Identity) -> SlotFile:
    """The slot file at ``path`` (a regular file of this user's: a link is not followed), checked against
    ``expected``; ``BadRequest`` saying what does not match."""
    try:
        with os.fdopen(open_private(path), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise BadRequest(f"no slot file {path.name!r}") from None
    except PlantedFile:
        raise BadRequest(f"{path.name!r} is not a slot file of this server's (a link, or not a regular file of "
                         "its user's)") from None
    except OSError as exc:
        raise BadRequest(f"cannot read slot file {path.name!r}: {exc.strerror}") from None
    name = path.name
    if not data.startswith(MAGIC):
        raise BadRequest(f"{name!r} is not an mpserve slot file")
    start = len(MAGIC) + _LENGTH.size
    if len(data) < start:
        raise BadRequest(f"slot file {name!r} is truncated: {len(data)} bytes, its header alone needs more")
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    try:
        if length > MAX_HEADER_BYTES:
            raise ValueError("header too long")
        header = json.loads(data[start:start + length])
        identity = Identity(**{k: header[k] for k in Identity.__dataclass_fields__})
        n_tokens, whole, state_bytes = int(header["n_tokens"]), int(header["whole"]), int(header["state_bytes"])
        if min(n_tokens, state_bytes) < 0:
            raise ValueError("a negative count")
    except (ValueError, KeyError, TypeError):
        raise BadRequest(f"slot file {name!r} is truncated or damaged: its header cannot be read") from None
    if identity.model != expected.model or (identity.n_params, identity.model_size) != (
            expected.n_params, expected.model_size):
        raise BadRequest(f"slot file {name!r} was saved from another model ({identity.model}, "
                         f"{identity.n_params} parameters); this one is {expected.model}, {expected.n_params}")
    if (identity.cache_type_k, identity.cache_type_v) != (expected.cache_type_k, expected.cache_type_v):
        raise BadRequest(f"slot file {name!r} was saved with KV cache types {identity.cache_type_k}/"
                         f"{identity.cache_type_v}; this instance uses {expected.cache_type_k}/"
                         f"{expected.cache_type_v}")
    if identity.kv_streams != expected.kv_streams:
        raise BadRequest(f"slot file {name!r} was saved by an instance with {identity.kv_streams} KV stream(s) "
                         f"(parallel, or 1 with kv_unified); this one has {expected.kv_streams}")
    body = start + length
    need = body + 4 * n_tokens + state_bytes
    if len(data) != need:
        raise BadRequest(f"slot file {name!r} is truncated: {len(data)} of {need} bytes"
                         if len(data) < need else f"slot file {name!r} has {len(data) - need} bytes past its end")
    tokens = list(struct.unpack_from(f"<{n_tokens}i", data, body))
    state = (ctypes.c_uint8 * state_bytes).from_buffer_copy(data, body + 4 * n_tokens)
    return SlotFile(identity, tokens, whole, state, state_bytes)
