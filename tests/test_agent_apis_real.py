"""The Responses and Messages APIs on a real model (Gemma 3 270M Q4_K_M, its own chat template), driven by the
SDKs: the OpenAI Agents SDK runs an agent with two function tools to its final answer, anthropic's
``messages.create`` and ``messages.stream`` make a tool round trip that ends in prose, and the greedy text
of one prompt is the same through chat completions, responses and messages."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import pytest
from agent_run import run_agent
from conftest import RealModel, ServerProcess
from gateway_thread import GatewayThread

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}
GREEDY = {"temperature": 0}
ANY_ONE: Any = {"type": "any", "disable_parallel_tool_use": True}


@pytest.fixture(scope="module")
def gateway(real_model: RealModel) -> Iterator[GatewayThread]:
    server = ServerProcess("--model", real_model.path, "--name", "gemma", "--parallel", "2",  # exact: the same
                           "--n-ctx", "4096", "--reuse", "exact").wait_ready(120)  # greedy text whatever came before
    gw = GatewayThread(server_name=server.name)
    yield gw
    gw.stop()
    assert not server.tracebacks()
    server.stop()


def test_the_greedy_text_is_the_same_through_all_three_apis(gateway: GatewayThread) -> None:
    prompt = "Name three colours of the rainbow."
    chat = gateway.openai().chat.completions.create(model="gemma", messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=24, temperature=0).choices[0].message.content
    response = gateway.openai().responses.create(model="gemma", input=prompt, max_output_tokens=24, temperature=0)
    message = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0).messages.create(
        model="gemma", max_tokens=24, extra_body=GREEDY, messages=[{"role": "user", "content": prompt}])
    assert chat and chat == response.output_text == message.content[0].text  # type: ignore[union-attr]


@pytest.mark.xfail(strict=True, reason="the model, not the server: after a tool's result Gemma 3 270M calls the same "
                   "tool again or repeats a token to the output limit, in its own turns with the Hermes tools prompt, "
                   "in llama.cpp's generic JSON tool format (grammar-constrained, the result as a user turn, a tool "
                   "turn or in its own turn) and in Gemma's tool_code style, driven by llama_cpp directly; "
                   "llama-server on the same GGUF degenerates too; in ChatML its 'answer' was a copy of the tool "
                   "result; so it does with the result as a user turn that asks the question again (the rendering "
                   "SmolLM2 answers best, docs/reasoning.md), a base model that never ends its turn; strict, so it "
                   "fails the run once a model here can do it")
def test_the_agents_sdk_runs_an_agent_with_two_function_tools_to_its_answer(gateway: GatewayThread) -> None:
    ran, result = run_agent(gateway.url, "gemma")
    assert ran and all(call.startswith(("get_weather(", "get_population(")) for call in ran)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert [i.type for i in result.new_items if i.type == "tool_call_item"], result.new_items


def test_an_anthropic_tool_round_trip_whole_and_streamed(gateway: GatewayThread) -> None:
    client = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=120)
    tools: Any = [{"name": "get_weather", "description": "The weather in a city", "input_schema": CITY}]
    ask: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw: dict[str, Any] = dict(model="gemma", max_tokens=64, extra_body=GREEDY, tools=tools)
    first = client.messages.create(messages=ask, tool_choice=ANY_ONE, **kw)
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and [u.name for u in uses] == ["get_weather"]
    jsonschema.validate(uses[0].input, CITY)
    with client.messages.stream(messages=ask, tool_choice=ANY_ONE, **kw) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, json.dumps(b.input)) for b in streamed.content if b.type == "tool_use"] == \
        [("get_weather", json.dumps(uses[0].input))]
    history: list[Any] = [*ask, {"role": "assistant", "content": [u.model_dump() for u in uses]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                        "content": "18 degrees and sunny"}]}]
    answer = client.messages.create(messages=history, tool_choice={"type": "none"}, **kw)
    assert answer.content[0].type == "text" and answer.content[0].text.strip()
    assert answer.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(messages=history, tool_choice={"type": "none"}, **kw) as stream:
        assert "".join(stream.text_stream) == answer.content[0].text
