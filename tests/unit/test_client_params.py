"""The client takes a request's parameters as one ``GenerateParams``, as they are (the gateway's path: made and
checked once, by ``GenerateParams.from_wire``), or as keywords, which it makes into one and checks. Nothing is
sent here: a stream's request is built when it is made and submitted on its first step."""

from __future__ import annotations

import pytest

from mpserve.client import AsyncClient
from mpserve.errors import BadRequest
from mpserve.wire.protocol import GenerateParams

pytestmark = pytest.mark.timeout(10)


def test_a_parameters_object_is_the_request_s_own() -> None:
    params = GenerateParams.from_wire({"max_tokens": 5, "temperature": 0.0, "stop": ["\n"], "n": 2})
    stream = AsyncClient("ipc:///nonexistent").stream("Hi", params=params)
    assert stream._request.params is params


def test_keywords_are_made_into_checked_parameters() -> None:
    client = AsyncClient("ipc:///nonexistent")
    stream = client.stream("Hi", max_tokens=5, stop=["\n"], logit_bias={"7": 1.5}, json_schema={"type": "object"})
    assert stream._request.params == GenerateParams(max_tokens=5, stop=("\n",), logit_bias=((7, 1.5),),
                                                    json_schema='{"type":"object"}')
    with pytest.raises(BadRequest, match="temperature"):
        client.stream("Hi", temperature=-1.0)


def test_parameters_given_both_ways_are_refused() -> None:
    client = AsyncClient("ipc:///nonexistent")
    with pytest.raises(BadRequest, match="not both.*max_tokens"):
        client.stream("Hi", params=GenerateParams(), max_tokens=3)
