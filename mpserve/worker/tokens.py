"""A worker's answer to TOKENIZE: the vocabulary of its loaded model, between two steps.

    broker --TOKENIZE(ticket)--> worker: answer(engine, msg) --TOKENS or ERROR(ticket)--> broker --> client

Text to tokens (with each token's bytes when ``with_pieces``), or tokens to text: the concatenated bytes
of their pieces, special tokens as written, decoded as UTF-8 with invalid bytes replaced.
"""

from __future__ import annotations

from itertools import accumulate

from mpserve.engine.interface import Engine
from mpserve.errors import MpserveError
from mpserve.wire import protocol as wire


def answer(engine: Engine, msg: wire.Tokenize) -> wire.Tokens | wire.Error:
    try:
        if msg.detokenize:
            pieces = [engine.token_bytes(t) for t in wire.unpack_tokens(msg.tokens)]
            return wire.Tokens(msg.id, msg.tokens, b"".join(pieces).decode("utf-8", "replace"))
        tokens = engine.tokenize(msg.text, msg.add_special)
        if not msg.with_pieces:
            return wire.Tokens(msg.id, wire.pack_tokens(tokens), msg.text)
        pieces = [engine.token_bytes(t) for t in tokens]
        return wire.Tokens(msg.id, wire.pack_tokens(tokens), msg.text, b"".join(pieces),
                           wire.pack_tokens(list(accumulate(map(len, pieces)))))
    except MpserveError as exc:
        return wire.Error(msg.id, exc.code, exc.message)
