"""TOKENIZE and TOKENS on the wire, and prompts of token ids."""

from __future__ import annotations

import msgpack
import pytest

from mpserve.errors import BadRequest, ProtocolError
from mpserve.wire import protocol as wire


def test_tokenize_tokens_and_token_prompts_round_trip() -> None:
    ask = wire.Tokenize("t1", "tiny", "hello", add_special=True, with_pieces=True, timeout=2.0, ticket="9")
    answer = wire.Tokens("t1", wire.pack_tokens([1, 2, 70000]), "hello", b"hello", wire.pack_tokens([2, 5]))
    request = wire.Request("r1", "", None, tokens=wire.pack_tokens(list(range(5000))))  # past a msgpack list's cap
    for msg in (ask, answer, request):
        assert wire.decode(wire.encode(msg)) == msg
    assert wire.unpack_tokens(wire.decode(wire.encode(request)).tokens) == list(range(5000))


def test_bad_token_fields_are_refused() -> None:
    with pytest.raises(ProtocolError, match="int32 token ids"):
        wire.decode([wire.VERSION, b"\x05", msgpack.packb({"id": "a", "tokens": b"abc"})])
    with pytest.raises(BadRequest, match="prompt token ids must be >= 0"):
        wire.decode(wire.encode(wire.Request("r", "", tokens=wire.pack_tokens([3, -1]))))
    with pytest.raises(BadRequest, match="token ids must be integers from 0 to 2147483647"):  # not a struct.error
        wire.pack_tokens([3, wire.MAX_TOKEN_ID + 1])
    with pytest.raises(BadRequest, match="'add_special' must be a boolean"):
        wire.decode([wire.VERSION, b"\x05", msgpack.packb({"id": "a", "add_special": 1})])
