"""A worker's answer to EMBED: the vectors of its embedding model (a reranker's scores, for a query), between
two steps.

    broker --EMBED(ticket)--> worker: answer(engine, msg) --EMBEDDINGS or ERROR(ticket)--> broker --> client

Every input of the message goes to the engine at once, which puts as many as fit in one decode.
"""

from __future__ import annotations

from mpserve.engine.interface import Embedder, Engine
from mpserve.errors import BadRequest, MpserveError
from mpserve.wire import protocol as wire


def answer(engine: Engine, msg: wire.Embed) -> wire.Embeddings | wire.Error:
    try:
        if not isinstance(engine, Embedder):
            raise BadRequest("this model is not served with embedding: true; it has no embeddings")
        most = (wire.MAX_MESSAGE_BYTES - 4096) // (4 * engine.dim)
        if len(msg.texts) + len(msg.tokens) > most:
            raise BadRequest(f"'input' may hold at most {most} inputs for this model ({engine.dim} numbers each), "
                             f"got {len(msg.texts) + len(msg.tokens)}")
        if msg.query is not None:
            scores, tokens = engine.rank(msg.query, list(msg.texts))
            return wire.Embeddings(msg.id, 1, scores.astype("<f4").tobytes(), tokens)
        inputs: list[str | list[int]] = [*msg.texts, *(wire.unpack_tokens(t, "input") for t in msg.tokens)]
        vectors, tokens = engine.embed(inputs)
        return wire.Embeddings(msg.id, engine.dim, vectors.astype("<f4").tobytes(), tokens)
    except MpserveError as exc:
        return wire.Error(msg.id, exc.code, exc.message)
