"""A loaded model's vocabulary through llama.cpp's C API, for the engines (``lib`` is the llama_cpp module):

    text ──tokenize──▶ token ids        token id ──piece──▶ its bytes (specials rendered)
    token ids ──detokenize──▶ their text (specials rendered)
"""

from __future__ import annotations

import ctypes
from typing import Any

from mpserve.errors import BadRequest


def tokenize(lib: Any, vocab: Any, text: str, add_special: bool, parse_special: bool) -> list[int]:
    """``text``'s token ids (``add_special``: with BOS where the model adds one)."""
    data = text.encode("utf-8")
    room = len(data) + 8
    buffer = (lib.llama_token * room)()
    n = lib.llama_tokenize(vocab, data, len(data), buffer, room, add_special, parse_special)
    if n < 0:
        room = -n
        buffer = (lib.llama_token * room)()
        n = lib.llama_tokenize(vocab, data, len(data), buffer, room, add_special, parse_special)
    if n < 0:
        raise BadRequest("the text cannot be tokenized")
    return list(buffer[:n])


def piece(lib: Any, vocab: Any, token: int) -> bytes:
    """The bytes of ``token`` (a valid id), special tokens as their text."""
    buffer = ctypes.create_string_buffer(256)
    n = lib.llama_token_to_piece(vocab, token, buffer, 256, 0, True)
    if n < 0:
        buffer = ctypes.create_string_buffer(-n)
        n = lib.llama_token_to_piece(vocab, token, buffer, -n, 0, True)
    return buffer.raw[:n]


def detokenize(lib: Any, vocab: Any, tokens: list[int]) -> str:
    """The text ``tokens`` spell, special tokens as their text (a character cut at the end: U+FFFD)."""
    ids = (lib.llama_token * len(tokens))(*tokens)
    room = 8 * len(tokens) + 16
    buffer = ctypes.create_string_buffer(room)
    n = lib.llama_detokenize(vocab, ids, len(tokens), buffer, room, False, True)
    if n < 0:
        buffer = ctypes.create_string_buffer(-n)
        n = lib.llama_detokenize(vocab, ids, len(tokens), buffer, -n, False, True)
    return buffer.raw[:max(n, 0)].decode("utf-8", errors="replace")
