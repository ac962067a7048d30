"""The request body's limits (mpserve.gateway.http.limits) on their own, on a Starlette request fed through ASGI's
receive: each limit holds at its bound and one past it, and each refusal names its limit. tests/test_limits.py
proves the same over a real socket; these fail on a one-line change to a bound or a check."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.requests import Request

from mpserve.errors import BadRequest
from mpserve.gateway.http import limits
from mpserve.wire import protocol as wire

pytestmark = pytest.mark.timeout(20)


def request(*pieces: bytes, length: str | None = None, then_wait: bool = False) -> Request:
    """A POST whose body arrives in ``pieces``; with ``then_wait``, the rest never comes."""
    todo = list(pieces)

    async def receive() -> dict[str, Any]:
        if todo:
            piece = todo.pop(0)
            return {"type": "http.request", "body": piece, "more_body": bool(todo) or then_wait}
        await asyncio.Event().wait()  # the client sends nothing more
        raise AssertionError("unreachable")

    headers = [(b"content-length", length.encode())] if length is not None else []
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers, "query_string": b""},
                   receive)


def read(req: Request, timeout: float = 5.0) -> Any:
    return asyncio.run(limits.read_json(req, timeout))


def too_large(size: int) -> str:
    return f"the request body is {size} bytes or more; at most {limits.MAX_BODY_BYTES} (MAX_BODY_BYTES)"


def test_a_body_in_pieces_is_read_whole_and_parsed() -> None:
    assert read(request(b'{"a": [1, {"b"', b': "c"}]}')) == {"a": [1, {"b": "c"}]}


def test_the_body_limit_is_the_wire_message_limit_and_the_documented_four_mib() -> None:
    assert limits.MAX_BODY_BYTES == wire.MAX_MESSAGE_BYTES == 4 * 1024 * 1024


def test_a_declared_length_over_the_limit_is_refused_before_any_byte_is_read() -> None:
    with pytest.raises(limits.Refused) as refused:
        read(request(then_wait=True, length=str(limits.MAX_BODY_BYTES + 1)))  # a read would wait forever
    error = refused.value.error
    assert (error.status, error.code, error.message) == (413, "request_too_large", too_large(limits.MAX_BODY_BYTES + 1))


@pytest.mark.parametrize("length", [str(limits.MAX_BODY_BYTES), "12abc", "+99999999", "", "٣"])
def test_a_declared_length_at_the_limit_or_not_a_number_is_left_to_the_bytes_read(length: str) -> None:
    assert read(request(b'{"ok": true}', length=length)) == {"ok": True}


def test_a_body_of_exactly_the_limit_is_read_and_one_byte_more_is_refused_as_it_arrives() -> None:
    text = b'"' + b"a" * (limits.MAX_BODY_BYTES - 2) + b'"'
    half = len(text) // 2
    assert read(request(text[:half], text[half:])) == "a" * (limits.MAX_BODY_BYTES - 2)
    with pytest.raises(limits.Refused) as refused:
        read(request(text[:half], text[half:] + b" ", then_wait=True))  # refused at once, not after a wait
    error = refused.value.error
    assert (error.status, error.code, error.message) == (413, "request_too_large", too_large(limits.MAX_BODY_BYTES + 1))


def test_a_body_that_does_not_arrive_within_the_read_timeout_is_a_408_naming_it() -> None:
    with pytest.raises(limits.Refused) as refused:
        read(request(b'{"a": ', then_wait=True), timeout=0.2)
    error = refused.value.error
    assert (error.status, error.code) == (408, "request_timeout")
    assert error.message == "the request body did not arrive within 0.2 s (the gateway's read timeout)"
    assert str(refused.value) == error.message


@pytest.mark.parametrize("body", [b'{"a": ', b"\xff\xfe{}", b"", b"[1, 2,]"])
def test_a_body_that_is_not_json_is_a_bad_request(body: bytes) -> None:
    with pytest.raises(BadRequest) as refused:
        read(request(body))
    assert refused.value.message.startswith("the request body is not valid JSON: ")


def nested(depth: int, kind: str) -> bytes:
    """A JSON value ``depth`` lists or objects deep."""
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a": ' * depth + b"1" + b"}" * depth


@pytest.mark.parametrize("kind", ["list", "object"])
def test_nesting_up_to_the_limit_is_read_and_deeper_is_refused_naming_it(kind: str) -> None:
    assert read(request(nested(limits.MAX_JSON_DEPTH, kind))) == json.loads(nested(limits.MAX_JSON_DEPTH, kind))
    with pytest.raises(BadRequest) as refused:
        read(request(nested(limits.MAX_JSON_DEPTH + 1, kind)))
    assert refused.value.message == (f"the request body is nested deeper than {limits.MAX_JSON_DEPTH} levels "
                                     "(MAX_JSON_DEPTH)")


def test_nesting_deeper_than_the_parser_can_follow_is_refused_the_same_way() -> None:
    with pytest.raises(BadRequest, match=r"nested deeper than 32 levels \(MAX_JSON_DEPTH\)"):
        read(request(nested(200_000, "list")))


def test_a_deep_value_beside_shallow_ones_counts() -> None:
    deep = nested(limits.MAX_JSON_DEPTH, "list")
    for body in (b'{"a": 1, "b": "x", "c": [], "d": ' + deep + b"}", b'{"d": ' + deep + b', "b": "x"}'):
        with pytest.raises(BadRequest, match="MAX_JSON_DEPTH"):
            read(request(body))


@pytest.mark.parametrize("body, value", [(b"5", 5), (b"null", None), (b"2.5", 2.5), (b"true", True), (b'"x"', "x")])
def test_a_body_that_is_one_value_is_left_to_the_parser(body: bytes, value: Any) -> None:
    assert read(request(body)) == value


@pytest.mark.parametrize("body", [b'"\\ud800"', b'["ok", "\\udfff"]', b'["\\udfff", "ok"]', b'{"a": "\\ud800"}',
                                  b'{"\\ud800": 1}', b'{"a": [{"b": "\\ud83d"}]}'])
def test_a_lone_surrogate_anywhere_is_refused_naming_it(body: bytes) -> None:
    with pytest.raises(BadRequest) as refused:
        read(request(body))
    surrogate = body.decode().split("\\u")[1][:4]  # as the body escapes it
    assert refused.value.message == (f"the request body holds a lone surrogate \\u{surrogate} in a string (half of "
                                     "a UTF-16 pair, not Unicode text)")


def test_a_surrogate_pair_is_text() -> None:
    assert read(request(b'{"a": "\\ud83d\\ude00"}')) == {"a": "\U0001F600"}


def test_a_prompt_and_a_message_list_are_held_to_their_limits_and_each_refusal_names_its_own() -> None:
    limits.check_sizes({"prompt": "p" * wire.MAX_PROMPT_CHARS, "messages": [{}] * limits.MAX_MESSAGES})
    with pytest.raises(BadRequest) as refused:
        limits.check_sizes({"prompt": "p" * (wire.MAX_PROMPT_CHARS + 1)})
    assert refused.value.message == (f"'prompt' is {wire.MAX_PROMPT_CHARS + 1} characters; at most "
                                     f"{wire.MAX_PROMPT_CHARS} (MAX_PROMPT_CHARS)")
    with pytest.raises(BadRequest) as refused:
        limits.check_sizes({"messages": [{}] * (limits.MAX_MESSAGES + 1)})
    assert refused.value.message == (f"'messages' has {limits.MAX_MESSAGES + 1} entries; at most {limits.MAX_MESSAGES} "
                                     "(MAX_MESSAGES)")


@pytest.mark.parametrize("body", [["p" * (wire.MAX_PROMPT_CHARS + 1)], "x", None,
                                  {"prompt": ["p"] * (wire.MAX_PROMPT_CHARS + 1)},
                                  {"messages": "m" * (limits.MAX_MESSAGES + 1)}])
def test_sizes_of_what_is_not_a_string_prompt_or_a_message_list_are_left_to_the_parser(body: Any) -> None:
    limits.check_sizes(body)
