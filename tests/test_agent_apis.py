"""OpenAI's Responses API, Anthropic's Messages API and llama-server's request extensions through the HTTP
gateway, driven by the SDKs themselves (``openai``, ``openai-agents``, ``anthropic``) against the built-in tiny
model: text whole and streamed, function tools forced by their grammar with a round trip, a JSON schema,
stored responses, the Agents SDK's run loop, the greedy text equal through all three APIs, and malformed
bodies answered 400 in each API's shape with no traceback anywhere. Gemma's runs are in test_agent_apis_real.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from conftest import ServerProcess
from gateway_thread import GatewayThread
from structured_cases import MAX_TOKENS, SCHEMAS

pytestmark = pytest.mark.timeout(120)

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
               "required": ["zone"]}
RESPONSE_TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER_PARAMS},
    {"type": "function", "name": "get_time", "parameters": TIME_PARAMS}]
ANTHROPIC_TOOLS: list[Any] = [{"name": "get_weather", "description": "The weather in a city",
                               "input_schema": WEATHER_PARAMS}, {"name": "get_time", "input_schema": TIME_PARAMS}]
ASK = "What is the weather in Paris?"
GREEDY = {"temperature": 0}  # anthropic's client no longer sends sampling parameters: the gateway still takes them


def claude(gateway: GatewayThread, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key=key, max_retries=0, timeout=30)


# --- Responses --------------------------------------------------------------------------------------

def test_responses_whole_and_streamed_agree_with_usage(gateway: GatewayThread) -> None:
    client = gateway.openai()
    whole = client.responses.create(model="tiny", input="hello", instructions="Be brief.", max_output_tokens=8,
                                    temperature=0)
    assert whole.object == "response" and whole.status == "incomplete"  # the tiny model runs to its limit
    assert whole.incomplete_details is not None and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text and whole.usage is not None and whole.usage.output_tokens == 8
    assert whole.usage.total_tokens == whole.usage.input_tokens + 8
    events = list(client.responses.create(model="tiny", input="hello", instructions="Be brief.",
                                          max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas == final.output_text == whole.output_text
    assert final.usage is not None and final.usage.output_tokens == 8


def test_responses_function_tool_round_trip_streamed_and_not(gateway: GatewayThread) -> None:
    client = gateway.openai()
    kw: dict[str, Any] = dict(model="tiny", tools=RESPONSE_TOOLS, parallel_tool_calls=False,
                              max_output_tokens=MAX_TOKENS, temperature=0)
    first = client.responses.create(input=ASK, tool_choice={"type": "function", "name": "get_weather"}, **kw)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and [c.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_PARAMS)
    events = list(client.responses.create(input=ASK, tool_choice={"type": "function", "name": "get_weather"},
                                          stream=True, **kw))
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(streamed) == json.loads(done.arguments) == json.loads(calls[0].arguments)
    assert events[-1].type == "response.completed"
    # the round trip: the call and its output as the next input, whole history sent ...
    history: list[Any] = [{"role": "user", "content": ASK}, *[c.model_dump() for c in calls],
                          {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C, sunny"}]
    answer = client.responses.create(input=history, tool_choice="none", **{**kw, "max_output_tokens": 8})
    assert answer.output_text and not [i for i in answer.output if i.type == "function_call"]
    # ... or continuing the stored response
    followed = client.responses.create(previous_response_id=first.id, tool_choice="none", input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C, sunny"}],
        **{**kw, "max_output_tokens": 8})
    assert followed.output_text == answer.output_text  # the same conversation, so the same greedy prompt


def test_responses_json_schema_streamed_and_not(gateway: GatewayThread) -> None:
    client = gateway.openai()
    for i, schema in enumerate(SCHEMAS):
        fmt: Any = {"format": {"type": "json_schema", "name": f"s{i}", "schema": schema, "strict": True}}
        whole = client.responses.create(model="tiny", input=ASK, text=fmt, max_output_tokens=MAX_TOKENS,
                                        temperature=0)
        assert whole.status == "completed"
        jsonschema.validate(json.loads(whole.output_text), schema)
        events = client.responses.create(model="tiny", input=ASK, text=fmt, max_output_tokens=MAX_TOKENS,
                                         temperature=0, stream=True)
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    with client.responses.stream(model="tiny", input=ASK, text=fmt, max_output_tokens=MAX_TOKENS,
                                 temperature=0) as stream:  # the client's own accumulating helper, on the last one
        assert stream.get_final_response().output_text == whole.output_text


def test_stored_responses_are_per_key(gateway: GatewayThread) -> None:
    mine, theirs = gateway.openai("key-a"), gateway.openai("key-b")
    made = mine.responses.create(model="tiny", input="hi", max_output_tokens=4, temperature=0)
    assert mine.responses.retrieve(made.id).output_text == made.output_text
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(made.id)
    with pytest.raises(openai.BadRequestError, match="no stored response"):
        theirs.responses.create(model="tiny", input="hi", previous_response_id=made.id, max_output_tokens=4)
    unstored = mine.responses.create(model="tiny", input="hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(unstored.id)
    mine.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(made.id)


def test_the_agents_sdk_runs_an_agent_with_two_function_tools(gateway: GatewayThread) -> None:
    import agents

    agents.set_tracing_disabled(True)  # nothing leaves this machine
    ran: list[tuple[str, dict[str, Any]]] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        ran.append(("get_weather", {"city": city}))
        return "18 C, sunny"

    @agents.function_tool
    def get_time(zone: int) -> str:
        """The time in a zone."""
        ran.append(("get_time", {"zone": zone}))
        return "12:00"

    async def run() -> tuple[Any, Any]:
        async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
            agent = agents.Agent(
                name="assistant", instructions="Answer with the tools.", tools=[get_weather, get_time],
                model=agents.OpenAIResponsesModel("tiny", client), tool_use_behavior="stop_on_first_tool",
                model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=MAX_TOKENS,
                                                    parallel_tool_calls=False))
            config = agents.RunConfig(tracing_disabled=True)
            whole = await agents.Runner.run(agent, ASK, run_config=config, max_turns=2)
            streamed = agents.Runner.run_streamed(agent, ASK, run_config=config, max_turns=2)
            async for _ in streamed.stream_events():
                pass
            return whole.final_output, streamed.final_output

    whole, streamed = asyncio.run(run())
    assert len(ran) == 2 and ran[0] == ran[1]
    assert whole == streamed == ("18 C, sunny" if ran[0][0] == "get_weather" else "12:00")


# --- Messages ---------------------------------------------------------------------------------------

def test_messages_whole_and_streamed_agree(gateway: GatewayThread) -> None:
    client = claude(gateway)
    kw: dict[str, Any] = dict(model="tiny", max_tokens=8, extra_body=GREEDY, system="Be brief.",
                              messages=[{"role": "user", "content": "hello"}])
    whole = client.messages.create(**kw)
    assert whole.type == "message" and whole.role == "assistant" and whole.stop_reason == "max_tokens"
    assert [b.type for b in whole.content] == ["text"] and whole.usage.output_tokens == 8
    assert whole.usage.input_tokens > 0
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == \
        whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)  # the prompt: cached ones counted apart


def test_messages_tool_round_trip_streamed_and_not(gateway: GatewayThread) -> None:
    client = claude(gateway)
    kw: dict[str, Any] = dict(model="tiny", max_tokens=MAX_TOKENS, extra_body=GREEDY, tools=ANTHROPIC_TOOLS,
                              tool_choice={"type": "tool", "name": "get_weather"})
    ask: list[Any] = [{"role": "user", "content": ASK}]
    first = client.messages.create(messages=ask, **kw)
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and [u.name for u in uses] == ["get_weather"]
    assert uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER_PARAMS)
    with client.messages.stream(messages=ask, **kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [("get_weather", uses[0].input)]
    history: list[Any] = [*ask, {"role": "assistant", "content": [u.model_dump() for u in uses]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                        "content": "18 C, sunny"}]}]
    answer = client.messages.create(messages=history, **{**kw, "max_tokens": 8, "tool_choice": {"type": "none"}})
    assert answer.stop_reason == "max_tokens" and answer.content[0].type == "text" and answer.content[0].text
    with client.messages.stream(messages=history, **{**kw, "max_tokens": 8, "tool_choice": {"type": "none"}}) as s:
        assert "".join(s.text_stream) == answer.content[0].text


def test_x_api_key_is_accepted_and_a_wrong_one_refused_in_anthropics_shape(tiny_server: ServerProcess) -> None:
    gw = GatewayThread(server_name=tiny_server.name, api_key="secret")
    try:
        reply = claude(gw, "secret").messages.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": "hi"}])
        assert reply.usage.output_tokens == 2
        with pytest.raises(anthropic.AuthenticationError) as refused:
            claude(gw, "wrong").messages.create(model="tiny", max_tokens=2,
                                                messages=[{"role": "user", "content": "hi"}])
        assert refused.value.body == {"type": "error", "error": {"type": "authentication_error", "message": (
            "a valid API key is required: send the header 'Authorization: Bearer KEY' (or 'x-api-key: KEY')")}}
        assert gw.openai("secret").responses.create(model="tiny", input="hi", max_output_tokens=2).output_text
    finally:
        gw.stop()


# --- all three ---------------------------------------------------------------------------------------

def test_the_greedy_text_is_the_same_through_all_three_apis(gateway: GatewayThread) -> None:
    prompt = "Tell me about the sea."
    chat = gateway.openai().chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=12, temperature=0).choices[0].message.content
    response = gateway.openai().responses.create(model="tiny", input=prompt, max_output_tokens=12, temperature=0)
    message = claude(gateway).messages.create(model="tiny", max_tokens=12, extra_body=GREEDY,
                                              messages=[{"role": "user", "content": prompt}])
    assert chat and chat == response.output_text == message.content[0].text  # type: ignore[union-attr]


MALFORMED: dict[str, list[Any]] = {
    "/v1/responses": [
        [], {}, {"input": 5}, {"input": []}, {"input": "x", "frobnicate": 1}, {"input": [{"role": "robot"}]},
        {"input": [{"type": "input_image", "image_url": "x"}]},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        {"input": [{"type": "function_call", "name": "f"}]}, {"input": [{"type": "function_call_output"}]},
        {"input": "x", "tools": [{"type": "web_search"}]}, {"input": "x", "tools": "all"},
        {"input": "x", "tool_choice": "sometimes"}, {"input": "x", "tool_choice": "required"},
        {"input": "x", "text": {"format": {"type": "xml"}}},
        {"input": "x", "text": {"format": {"type": "json_schema"}}},
        {"input": "x", "reasoning": {"effort": "high"}}, {"input": "x", "background": "yes"},
        {"input": "x", "background": True, "store": False},
        {"input": "x", "include": ["reasoning.encrypted_content"]}, {"input": "x", "truncation": "auto"},
        {"input": "x", "previous_response_id": "resp_nope"}, {"input": "x", "store": "yes"},
        {"input": "x", "metadata": {"a": 1}}, {"input": "x", "max_output_tokens": 0},
        {"input": "x", "temperature": "hot"}, {"input": "x", "instructions": ["a"]},
        {"input": "x", "prompt": {"id": "pmpt_1"}}, {"input": "x", "conversation": "conv_1"},
    ],
    "/v1/messages": [
        [], {}, {"max_tokens": 4}, {"max_tokens": 4, "messages": []}, {"max_tokens": 4, "messages": "hi"},
        {"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
        {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "1", "name": "f",
                                                                     "input": {}}]}]},
        {"max_tokens": 4, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "1"}]}]},
        {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
        {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "bash_20250124"}]},
        {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}},
        {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
        {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled"}},
        {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "stop_sequences": "x"},
        {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "system": 5},
        {"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]},
        {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "frobnicate": True},
    ],
}


@pytest.mark.parametrize("path", sorted(MALFORMED))
def test_malformed_bodies_get_400_in_each_apis_shape(gateway: GatewayThread, tiny_server: ServerProcess,
                                                     path: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    for body in MALFORMED[path]:
        for stream in (False, True):
            sent = {**body, "stream": True} if stream and isinstance(body, dict) else body
            r = httpx.post(gateway.url + path, json=sent, timeout=30)
            assert r.status_code == 400, (sent, r.text)
            error = r.json()
            if path == "/v1/messages":
                assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
                message = error["error"]["message"]
            else:
                assert error["error"]["type"] == "invalid_request_error" and error["error"]["code"] == "bad_request"
                message = error["error"]["message"]
            assert message and "Traceback" not in message
    assert not [r for r in caplog.records if r.name.startswith(("mpserve", "uvicorn"))
                and (r.exc_info or "Traceback" in r.getMessage())]
    assert not tiny_server.tracebacks()
    counted = gateway.metrics()
    assert counted[("mpserve_http_requests_total", (("code", "bad_request"), ("endpoint", path)))] >= \
        2 * len(MALFORMED[path])


def test_a_refused_field_is_named(gateway: GatewayThread) -> None:
    for body, named in [({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
                        ({"input": "x", "reasoning": {"effort": "high"}}, "'reasoning.effort'"),
                        ({"input": "x", "seed": 3}, "seed")]:
        r = httpx.post(gateway.url + "/v1/responses", json=body, timeout=30)
        assert r.status_code == 400 and named in r.json()["error"]["message"], r.text


# --- llama-server's extensions -----------------------------------------------------------------------

def test_llama_server_extensions_are_mapped_or_ignored_and_said_so(gateway: GatewayThread) -> None:
    body = {"model": "tiny", "prompt": "hello", "temperature": 0, "n_predict": 5, "cache_prompt": True,
            "samplers": ["top_k", "temperature"], "n_probs": 2}
    r = httpx.post(gateway.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["x-mpserve-ignored"] == "cache_prompt, samplers"
    choice = r.json()["choices"][0]
    assert r.json()["usage"]["completion_tokens"] == 5 and len(choice["logprobs"]["top_logprobs"][0]) == 2
    chat = httpx.post(gateway.url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n_predict": 3, "cache_prompt": True,
        "n_probs": 1, "stream": True})
    assert chat.status_code == 200 and chat.headers["x-mpserve-ignored"] == "cache_prompt"
    plain = httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                       timeout=30)
    assert "x-mpserve-ignored" not in plain.headers
    for refused in ({"frobnicate": 1}, {"n_predict": 3, "max_tokens": 3}):
        r = httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "x", **refused}, timeout=30)
        assert r.status_code == 400, r.text
