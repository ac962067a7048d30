"""The host store's entry layout (``mpserve.engine.host_store``): an entry's name, and its header read and checked.

    address(key, tokens, salt) ──▶ the entry's name: a digest of the store's key, the salt and the tokens
    read_header(data, file_size, key) ──▶ Header (its counts add up to the file's size), or why the entry is bad

An entry is MAGIC · header length (u32 LE) · CRC32 of the rest (u32 LE) · header (JSON: key, tokens, state bytes,
summary, and the salt in hex unless empty) · tokens (int32 LE) · state. The remote tier
(``mpserve.engine.remote_store``) holds the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

from mpserve.wire.prefix import MAX_BLOCKS

MAGIC = b"MPKVST01"
PREFIX = struct.Struct("<8sII")  # magic, header length, CRC32 of what follows
MAX_HEADER_BYTES = 1 << 20
SUFFIX = ".kv"
_SALT = re.compile(r"(?:[0-9a-f]{2}){0,32}")  # an entry's salt in hex (mpserve.wire.salt: at most 32 bytes)


@dataclass(frozen=True)
class Header:
    length: int  # of the JSON header
    crc: int
    tokens: int
    state_bytes: int
    summary: tuple[int, ...]
    salt: bytes


def read_header(data: bytes | bytearray, file_size: int, key: str) -> Header | str:
    """The header of an entry file of ``file_size`` bytes that starts with ``data``, checked (the magic, the JSON,
    this key, counts that add up to the file's size, a summary of block hashes), or why the entry is bad."""
    if len(data) < PREFIX.size or data[:8] != MAGIC:
        return "not a store entry"
    _, length, crc = PREFIX.unpack_from(data)
    if length > MAX_HEADER_BYTES:
        return "its header is too long"
    if len(data) < PREFIX.size + length:
        return "truncated"
    try:
        fields = json.loads(bytes(data[PREFIX.size:PREFIX.size + length]))
    except (ValueError, RecursionError):
        return "its header is not JSON"
    if not isinstance(fields, dict):
        return "its header is not a JSON object"
    if fields.get("key") != key:
        return "foreign (saved under another key)"
    tokens, state_bytes, summary = fields.get("tokens"), fields.get("state_bytes"), fields.get("summary", [])
    if not (_count(tokens) and _count(state_bytes)):
        return "its token or state count is not a count"
    expected = PREFIX.size + length + 4 * tokens + state_bytes  # bounds both counts by the file's size
    if expected != file_size:
        return f"{'truncated' if expected > file_size else 'padded'}: its counts say {expected} bytes, the file has " \
               f"{file_size}"
    if not (isinstance(summary, list) and len(summary) <= MAX_BLOCKS
            and all(type(h) is int and 0 <= h < 1 << 64 for h in summary)):
        return "its summary is not a list of block hashes"
    salt = fields.get("salt", "")
    if not (isinstance(salt, str) and _SALT.fullmatch(salt)):
        return "its salt is not a salt in hex"
    return Header(length, crc, tokens, state_bytes, tuple(summary), bytes.fromhex(salt))


def _count(value: object) -> TypeGuard[int]:
    return type(value) is int and value >= 0


def address(key: str, tokens: Sequence[int], salt: bytes = b"") -> str:
    """An entry's name: a digest of the key, the salt (none when empty: the addresses from before salts) and the
    tokens. A salted key text holds a "/", which no key has, and is longer: no salt's address is another's."""
    digest = hashlib.sha256((f"{key}/{salt.hex()}" if salt else key).encode())
    digest.update(struct.pack(f"<{len(tokens)}i", *tokens))
    return digest.hexdigest()[:32] + SUFFIX
