"""OpenAI's ``/v1/embeddings`` shapes: the request body in, ``Client.embed`` arguments out, the answer back.
No I/O here.

    POST /v1/embeddings  {"input": str | [str, ...] | [id, ...] | [[id, ...], ...], "model": optional,
                          "encoding_format": "float" (default) | "base64", "user": ignored}
        -> {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": [float, ...] or the
            base64 of its float32 little-endian bytes}], "model": name, "usage": {"prompt_tokens", "total_tokens"}}

``dimensions`` is refused (the model's size is what it is); the input is checked here and again by the
broker (``protocol.Embed``), before any worker.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Any

from mpserve.client import Embedded
from mpserve.errors import BadRequest
from mpserve.wire import protocol as wire

from .tokens import token_ids

FORMATS = ("float", "base64")
FIELDS = frozenset({"input", "model", "encoding_format", "user", "dimensions"})  # "dimensions" only as null


@dataclass(frozen=True)
class EmbedCall:
    model: str | None
    inputs: str | list[str] | list[int] | list[list[int]]
    encoding_format: str


def parse(body: Any) -> EmbedCall:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise BadRequest(f"unrecognized request argument(s) supplied: {', '.join(unknown)}")
    given = {k: v for k, v in body.items() if v is not None}
    if "dimensions" in given:
        raise BadRequest("'dimensions' is not supported by mpserve: a model's embeddings have its own size")
    model = given.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    encoding = given.get("encoding_format", "float")
    if encoding not in FORMATS:
        raise BadRequest(f"'encoding_format' must be one of {', '.join(FORMATS)}, got {encoding!r:.40}")
    return EmbedCall(model, _inputs(given.get("input")), encoding)


def _inputs(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    why = "'input' must be a non-empty string, a list of them, a list of token ids or a list of those lists"
    if isinstance(value, str) and value:
        return value
    if not isinstance(value, list) or not value:
        raise BadRequest(why)
    if len(value) > wire.MAX_EMBED_INPUTS:
        raise BadRequest(f"'input' may hold at most {wire.MAX_EMBED_INPUTS} inputs, got {len(value)}")
    if all(isinstance(v, str) and v for v in value):
        return value
    if all(isinstance(v, int) for v in value):
        return token_ids(value, "input")
    if all(isinstance(v, list) and v for v in value):
        return [token_ids(v, "input") for v in value]
    raise BadRequest(why)


def answer(result: Embedded, model: str, encoding_format: str) -> dict[str, Any]:
    def encoded(vector: list[float]) -> list[float] | str:
        if encoding_format == "float":
            return vector
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v)}
                     for i, v in enumerate(result.vectors)],
            "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}}
