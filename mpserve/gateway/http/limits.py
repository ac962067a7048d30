"""What a request body may be, checked before anything else reads it; each refusal names its limit.

    HTTP body ──▶ read_json ──▶ check_sizes ──▶ openai.parse
                  │ Content-Length or bytes read over MAX_BODY_BYTES: 413
                  │ not all of it within the read timeout: 408
                  │ not JSON, nested deeper than MAX_JSON_DEPTH, or a string that is not Unicode text: 400
                                 │ a prompt over MAX_PROMPT_CHARS, more than MAX_MESSAGES messages: 400

The stop list (``MAX_STOP_STRINGS``) and the other parameters are checked by ``protocol.GenerateParams``, a
chat's rendered prompt by the client, both with BadRequest (400). The connection itself (header timeout,
the bound on open connections) is ``guard``'s.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from starlette.requests import Request

from mpserve.errors import BadRequest
from mpserve.waits import within
from mpserve.wire import protocol as wire

from .errors import HttpError

MAX_BODY_BYTES = wire.MAX_MESSAGE_BYTES
MAX_JSON_DEPTH = 32  # an OpenAI body needs five levels (messages, a message, its content parts, a part)
MAX_MESSAGES = 4096
# JSON may escape half of a UTF-16 pair alone ("\ud800"); Python reads it into a str that UTF-8 cannot encode
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class Refused(Exception):
    """A body refused with a status of its own (413, 408), as an OpenAI error."""

    def __init__(self, error: HttpError) -> None:
        super().__init__(error.message)
        self.error = error


async def read_json(request: Request, timeout: float) -> Any:
    """The body, parsed, once it is all there; raises Refused or BadRequest."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large(int(declared))
    try:
        body = await within(_read(request), timeout)
    except asyncio.TimeoutError:
        raise Refused(HttpError(408, "request_timeout", f"the request body did not arrive within {timeout:g} s "
                                    "(the gateway's read timeout)")) from None
    try:
        value = json.loads(body)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if _checked_depth(value) > MAX_JSON_DEPTH:
        raise _too_deep()
    return value


def check_sizes(body: Any) -> None:
    """Refuse what is too large to render or send before ``api.openai.parse`` looks at it."""
    if not isinstance(body, dict):
        return  # parse refuses it
    prompt, messages = body.get("prompt"), body.get("messages")
    if isinstance(prompt, str) and len(prompt) > wire.MAX_PROMPT_CHARS:
        raise BadRequest(f"'prompt' is {len(prompt)} characters; at most {wire.MAX_PROMPT_CHARS} (MAX_PROMPT_CHARS)")
    if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
        raise BadRequest(f"'messages' has {len(messages)} entries; at most {MAX_MESSAGES} (MAX_MESSAGES)")


async def _read(request: Request) -> bytes:
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > MAX_BODY_BYTES:
            raise _too_large(len(body))
    return bytes(body)


def _too_large(size: int) -> Refused:
    return Refused(HttpError(413, "request_too_large", f"the request body is {size} bytes or more; at most "
                                 f"{MAX_BODY_BYTES} (MAX_BODY_BYTES)"))


def _too_deep() -> BadRequest:
    return BadRequest(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels (MAX_JSON_DEPTH)")


def _checked_depth(value: Any) -> int:
    """How deeply lists and objects nest (a scalar: 0), without recursion. Raises BadRequest where a string,
    a key or a value, holds a lone surrogate: no message, log line or prompt could carry it on."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, str):
            _check_text(item)
            continue
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, level)
            if isinstance(item, dict):
                for key in item:
                    _check_text(key)
            todo.extend((child, level + 1) for child in children if isinstance(child, (dict, list, str)))
    return deepest


def _check_text(text: str) -> None:
    found = _LONE_SURROGATE.search(text)
    if found:
        raise BadRequest(f"the request body holds a lone surrogate \\u{ord(found.group()):04x} in a string (half "
                         "of a UTF-16 pair, not Unicode text)")
