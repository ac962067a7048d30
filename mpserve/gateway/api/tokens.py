"""llama-server's ``/tokenize`` and ``/detokenize`` shapes: request bodies in, ``Client.tokenize`` /
``detokenize`` arguments out, and their answers back in those shapes. No I/O here.

    POST /tokenize    {"content": str, "add_special": false, "with_pieces": false, "model": optional}
                      -> {"tokens": [id, ...]}, or with pieces {"tokens": [{"id": id, "piece": str}, ...]}
                         (a piece that is not whole UTF-8 comes as its list of byte values, as llama-server
                         sends it)
    POST /detokenize  {"tokens": [id, ...], "model": optional} -> {"content": str}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mpserve.client import Tokenized
from mpserve.errors import BadRequest
from mpserve.wire import protocol as wire

TOKENIZE_FIELDS = frozenset({"content", "add_special", "with_pieces", "model"})
DETOKENIZE_FIELDS = frozenset({"tokens", "model"})

@dataclass(frozen=True)
class TokenizeCall:
    model: str | None
    content: str
    add_special: bool
    with_pieces: bool


def parse_tokenize(body: Any) -> TokenizeCall:
    given = _object(body, TOKENIZE_FIELDS)
    content = given.get("content")
    if not isinstance(content, str) or len(content) > wire.MAX_PROMPT_CHARS:
        raise BadRequest(f"'content' is required and must be a string of at most {wire.MAX_PROMPT_CHARS} characters")
    flags = {k: given.get(k, False) for k in ("add_special", "with_pieces")}
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise BadRequest(f"'{key}' must be a boolean")
    return TokenizeCall(_model(given), content, flags["add_special"], flags["with_pieces"])


def parse_detokenize(body: Any) -> tuple[str | None, list[int]]:
    given = _object(body, DETOKENIZE_FIELDS)
    return _model(given), token_ids(given.get("tokens"), "tokens")


def token_ids(value: Any, key: str) -> list[int]:
    """A list of token ids (integers 0 .. MAX_TOKEN_ID, what the wire's int32 columns hold), else BadRequest
    naming ``key``."""
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                              and 0 <= t <= wire.MAX_TOKEN_ID for t in value):
        raise BadRequest(f"'{key}' must be a list of token ids (integers from 0 to {wire.MAX_TOKEN_ID})")
    if len(value) > wire.MAX_PROMPT_CHARS:
        raise BadRequest(f"'{key}' has {len(value)} tokens, more than {wire.MAX_PROMPT_CHARS}")
    return value


def tokenize_answer(result: Tokenized, with_pieces: bool) -> dict[str, Any]:
    if not with_pieces:
        return {"tokens": result.tokens}
    return {"tokens": [{"id": token, "piece": _piece(piece)} for token, piece in zip(result.tokens, result.pieces,
                                                                                     strict=True)]}


def _piece(data: bytes) -> str | list[int]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def _object(body: Any, keys: frozenset[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - keys)
    if unknown:
        raise BadRequest(f"unrecognized request argument(s) supplied: {', '.join(unknown)}")
    return {k: v for k, v in body.items() if v is not None}


def _model(given: dict[str, Any]) -> str | None:
    model = given.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    return model
