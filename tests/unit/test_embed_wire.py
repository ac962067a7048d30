"""EMBED and EMBEDDINGS on the wire, and the embedding settings of a model."""

from __future__ import annotations

import struct

import pytest

from mpserve.config import loader as cfg
from mpserve.errors import BadRequest, ConfigError, ProtocolError
from mpserve.wire import protocol as wire

pytestmark = pytest.mark.timeout(10)


def test_embed_round_trips_and_refuses_what_no_worker_should_see() -> None:
    for msg in (wire.Embed("e1", "emb", texts=("a", "b")), wire.Embed("e2", tokens=(wire.pack_tokens([1, 2]),))):
        assert wire.decode(wire.encode(msg)) == msg
    for body, words in [({}, "not empty"), ({"texts": ["a"], "tokens": [wire.pack_tokens([1])]}, "not empty"),
                        ({"texts": [""]}, "each 'texts' must hold 1 to"), ({"texts": [3]}, "'texts' must be a string"),
                        ({"texts": ["x"] * 2049}, "'texts' must hold at most 2048 items"),
                        ({"tokens": [wire.pack_tokens([-1])]}, "token ids >= 0"),
                            ({"tokens": [b""]}, "each 'tokens' must hold at least 1 bytes"),
                        ({"texts": ["x"], "timeout": 0}, "'timeout' must be between")]:
        with pytest.raises(BadRequest, match=words):
            wire.decode_as(wire.Embed, wire.pack({"id": "e", **body}))


def test_embeddings_carry_float32_rows() -> None:
    msg = wire.Embeddings("e", 2, struct.pack("<4f", 1, 0, 0.5, -0.5), 7)
    assert wire.decode(wire.encode(msg)).rows() == [[1.0, 0.0], [0.5, -0.5]]
    with pytest.raises(ProtocolError, match="float32 vectors of 2"):
        wire.decode_as(wire.Embeddings, wire.pack({"id": "e", "dim": 2, "vectors": b"\0" * 12}))


def test_pooling_belongs_to_embedding_models() -> None:
    built = cfg.build({"models": [{"path": "builtin:tiny-embed", "embedding": True, "pooling": "cls"}]})
    assert built.models[0].embedding and built.models[0].pooling == "cls" and built.models[0].name == "tiny-embed"
    for entry, words in [({"path": "builtin:tiny", "pooling": "mean"}, "applies to embedding models"),
                         ({"path": "builtin:tiny", "embedding": True, "pooling": "max"}, "allowed: mean, cls, last"),
                         ({"path": "echo", "embedding": True}, "the echo backend has no embeddings"),
                         ({"path": "builtin:huge"}, "allowed: builtin:tiny, builtin:bench, builtin:tiny-embed")]:
        with pytest.raises(ConfigError, match=words):
            cfg.build({"models": [entry]})
