"""Structured output and tools through the HTTP gateway, with the official openai client: response_format
json_object and json_schema, ``beta.chat.completions.parse`` with a pydantic model, tools with tool_choice
required and named (valid calls every time, streamed ones reassembling to the same; cut by max_tokens, the
calls that completed and never text, through chat, responses and messages), a round trip with a tool's answer,
and malformed input answered 400."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from conftest import ServerProcess
from gateway_thread import GatewayThread
from pydantic import BaseModel, Field
from structured_cases import MAX_TOKENS, SCHEMAS

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"]}}}
TOOLS: list[Any] = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=130)
    tags: list[str] = Field(max_length=2)


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayThread]:
    server = ServerProcess("--instances", "1", "--parallel", "2").wait_ready()
    gw = GatewayThread(server_name=server.name)
    yield gw
    gw.stop()
    server.stop()


def chat(gateway: GatewayThread, **kw: Any) -> Any:
    return gateway.openai().chat.completions.create(model="tiny", messages=kw.pop("messages", ASK), temperature=0,
                                                    max_tokens=kw.pop("max_tokens", MAX_TOKENS), **kw)


def test_response_format_json_schema_streamed_and_not(gateway: GatewayThread) -> None:
    for i, schema in enumerate(SCHEMAS):
        fmt: Any = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        whole = chat(gateway, response_format=fmt)
        assert whole.choices[0].finish_reason == "stop"
        text = whole.choices[0].message.content
        jsonschema.validate(json.loads(text), schema)
        streamed = "".join(c.choices[0].delta.content or "" for c in chat(gateway, response_format=fmt, stream=True)
                           if c.choices)
        assert streamed == text


def test_response_format_json_object_and_the_grammar_extension(gateway: GatewayThread) -> None:
    reply = chat(gateway, response_format={"type": "json_object"}, max_tokens=600)
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # a random-weight model may not close its object: the text is returned as it is
        assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content.startswith("{")
    completion = gateway.openai().completions.create(model="tiny", prompt="x", max_tokens=10, temperature=0,
                                                     extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert completion.choices[0].text in ("yes", "no")


def test_a_cut_constrained_reply_is_returned_with_finish_reason_length(gateway: GatewayThread) -> None:
    reply = chat(gateway, max_tokens=5, response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "object", "properties": {"t": {"type": "string"}}, "required": ["t"]}}})
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content.startswith("{")


def test_parse_with_a_pydantic_model(gateway: GatewayThread) -> None:
    client = gateway.openai()
    parsed = client.beta.chat.completions.parse(model="tiny", messages=ASK, temperature=0, max_tokens=MAX_TOKENS,
                                                response_format=Person)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 130


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("parallel", [True, False])
def test_forced_tool_calls_are_valid_every_time_and_stream_the_same(gateway: GatewayThread, choice: Any,
                                                                    parallel: bool) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(3):
        kw: dict[str, Any] = dict(tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel, seed=seed,
                                  temperature=0.9)
        reply = gateway.openai().chat.completions.create(model="tiny", messages=ASK, max_tokens=MAX_TOKENS, **kw)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls" and message.tool_calls
        assert len(message.tool_calls) == 1 or (parallel and choice == "required")
        for call in message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            if isinstance(choice, dict):
                assert call.function.name == "get_time"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        stream = gateway.openai().chat.completions.create(model="tiny", messages=ASK, max_tokens=MAX_TOKENS,
                                                          stream=True, **kw)
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in stream:
            for delta in chunk.choices[0].delta.tool_calls or ():
                got = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                got["name"] += delta.function.name or "" if delta.function else ""
                got["arguments"] += delta.function.arguments or "" if delta.function else ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
            [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def test_a_forced_reply_cut_by_max_tokens_is_the_calls_it_completed_never_text(gateway: GatewayThread) -> None:
    kw: dict[str, Any] = dict(tools=TOOLS, tool_choice="required")  # greedy; parallel_tool_calls: 1 to 4 calls
    uncut = chat(gateway, max_tokens=400, **kw)
    full = [(c.function.name, c.function.arguments) for c in uncut.choices[0].message.tool_calls]
    assert uncut.choices[0].finish_reason == "tool_calls" and len(full) >= 2, full  # the greedy reply of this model
    returned = set()
    for max_tokens in range(1, uncut.usage.completion_tokens, 12):
        whole = chat(gateway, max_tokens=max_tokens, **kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
        assert whole.finish_reason == "length" and not whole.message.content, (max_tokens, whole)
        assert calls == full[:len(calls)]  # those that completed (cut in a closing tag, all), the cut one dropped
        returned.add(len(calls))
        streamed: dict[int, list[str]] = {}
        finish = None
        for chunk in chat(gateway, max_tokens=max_tokens, stream=True, **kw):
            assert not chunk.choices[0].delta.content, chunk  # no text, streamed either
            for delta in chunk.choices[0].delta.tool_calls or ():
                got = streamed.setdefault(delta.index, ["", ""])
                got[0] += delta.function.name or "" if delta.function else ""
                got[1] += delta.function.arguments or "" if delta.function else ""
            finish = chunk.choices[0].finish_reason or finish
        sent = [tuple(c) for c in streamed.values()]  # as they formed: those that completed, then the cut one's start
        assert finish == "length" and sent[:len(calls)] == calls and len(sent) - len(calls) <= 1
        assert all(s[0] == f[0] and f[1].startswith(s[1]) for s, f in zip(sent[len(calls):], full[len(calls):],
                                                                         strict=False))
    assert 0 in returned and len(returned) > 1  # cut before its first call ended, and after one or more had


def test_a_cut_forced_reply_is_calls_not_text_through_responses_and_messages_too(gateway: GatewayThread) -> None:
    functions: list[Any] = [{"type": "function", **t["function"]} for t in TOOLS]
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=30)
    for max_tokens in (1, 60, 120):
        response = gateway.openai().responses.create(model="tiny", input=ASK[0]["content"], tools=functions,
                                                     tool_choice="required", max_output_tokens=max_tokens,
                                                     temperature=0)
        assert response.status == "incomplete" and not response.output_text, response.output
        calls = [i for i in response.output if i.type == "function_call"]
        assert all(isinstance(json.loads(i.arguments), dict) for i in calls)
        assert all(i.type == "function_call" or (i.type == "message" and not i.content[0].text)  # type: ignore[union-attr]
                   for i in response.output), response.output
        message = claude.messages.create(
            model="tiny", max_tokens=max_tokens, messages=ASK, tool_choice={"type": "any"},
            tools=[{"name": f["name"], "input_schema": f["parameters"]} for f in functions],
            extra_body={"temperature": 0})
        assert message.stop_reason == "max_tokens"
        assert all(b.type == "tool_use" or (b.type == "text" and not b.text) for b in message.content), message
        assert [b.name for b in message.content if b.type == "tool_use"] == [i.name for i in calls]


def test_a_round_trip_with_a_tool_answer(gateway: GatewayThread) -> None:
    first = chat(gateway, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).choices[0].message
    history: list[Any] = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for c in first.tool_calls or ()]}]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "18 degrees, sunny"} for c in first.tool_calls or ()]
    answer = chat(gateway, messages=history, tools=TOOLS, tool_choice="none", max_tokens=16)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    auto = chat(gateway, messages=history, tools=TOOLS, max_tokens=16)  # random weights: prose, not a call
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


MALFORMED: list[dict[str, Any]] = [
    {"response_format": {"type": "xml"}}, {"response_format": {"type": "json_schema"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                       "minProperties": 1}}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
    {"grammar": "root ::= nothing-defined"}, {"grammar": 'root ::= "a"{3,1}'},
    {"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}},
    {"tools": [{"type": "function"}]}, {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"tool_choice": "required"}, {"tools": TOOLS, "tool_choice": "sometimes"},
    {"tools": [WEATHER, WEATHER]}, {"tools": TOOLS, "parallel_tool_calls": "yes"},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"oneOf": [{}]}}}}}], "tool_choice": "required"},
    {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "function": {
        "name": "f", "arguments": "not json"}}]}]},
    {"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]},
]


def test_malformed_structured_requests_are_400(gateway: GatewayThread) -> None:
    for body in MALFORMED:
        response = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30,
                              json={"model": "tiny", "messages": ASK, "max_tokens": 4, **body})
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["code"] == "bad_request"
    assert chat(gateway, max_tokens=4).usage.completion_tokens == 4


@pytest.mark.timeout(60)
def test_a_schema_too_large_to_compile_is_400_naming_the_field_before_compiling(gateway: GatewayThread) -> None:
    """Issue 59's schema: a $ref to a definition with a 48-character name holding 5,800 properties. It took the
    gateway's event loop, then the broker's, 13 s each to compile and refuse; its properties are counted now."""
    name = "D" * 48
    schema = {"$ref": f"#/$defs/{name}", "$defs": {name: {"type": "object",
                                                          "properties": {f"p{i}": {} for i in range(5800)}}}}
    response = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": ASK, "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "bad_request"
    assert error["message"].startswith("'json_schema' has 5800 properties in all, over the limit of"), error
    assert httpx.get(f"{gateway.url}/health", timeout=10).status_code == 200


def test_openai_client_errors_are_bad_request(gateway: GatewayThread) -> None:
    with pytest.raises(openai.BadRequestError, match="keyword 'oneOf' is not supported"):
        chat(gateway, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "oneOf": [{"type": "null"}]}}})


def test_langchain_binds_tools_and_structures_output(gateway: GatewayThread) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", model="tiny", temperature=0,  # type: ignore[arg-type]
                     max_tokens=MAX_TOKENS, max_retries=0, timeout=30)
    message = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER["function"]["parameters"])
    anything = llm.bind_tools(TOOLS, tool_choice="any").invoke("Weather or time?")
    assert anything.tool_calls and {c["name"] for c in anything.tool_calls} <= {"get_weather", "get_time"}
    person = llm.with_structured_output(Person).invoke("Who is it?")
    assert isinstance(person, Person)
