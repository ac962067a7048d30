"""Forced tool calls in the template family's own format, through the HTTP gateway: the built-in tiny model served
with ChatML (Hermes' calls), ``qwen3-coder`` (XML parameters), ``glm`` (it thinks, then ``<arg_key>`` pairs) and
``gpt-oss`` (Harmony: it thinks on the analysis channel, then calls on the commentary one), one server for all. Its
random weights write a call only because the family's grammar makes them; each reply parses into ``tool_calls``
whose arguments hold to the tool's schema, streamed as the whole reply reads it, through Responses too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from gateway_thread import GatewayThread

pytestmark = pytest.mark.timeout(180)

FAMILIES = ("chatml", "qwen3-coder", "glm", "gpt-oss")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                     "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "Weather in Paris for three days?"}]


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The server in front of conftest's ``gateway``: the tiny model once per family, named after it."""
    from conftest import ServerProcess

    config = tmp_path_factory.mktemp("tool-formats") / "models.yaml"
    config.write_text("models:\n" + "".join(f"  - {{name: {f}, path: builtin:tiny, n_ctx: 2048"
                                            + ("" if f == "chatml" else f", chat_template: {f}") + "}\n"
                                            for f in FAMILIES))
    server = ServerProcess("--config", str(config)).wait_ready()
    yield server
    server.stop()


def body(family: str, **extra: Any) -> dict[str, Any]:
    return {"model": family, "messages": ASK, "tools": TOOLS, "max_tokens": 300, "temperature": 1.0,
            "reasoning_budget": 6, **extra} if family in ("glm", "gpt-oss") else \
        {"model": family, "messages": ASK, "tools": TOOLS, "max_tokens": 300, "temperature": 1.0, **extra}


def streamed(gateway: GatewayThread, request: dict[str, Any]) -> tuple[list[tuple[str, str]], str, str]:
    calls: dict[int, list[str]] = {}
    content = finish = ""
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json={**request, "stream": True},
                      timeout=120) as answer:
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                content += choice["delta"].get("content") or ""
                for call in choice["delta"].get("tool_calls") or ():
                    got = calls.setdefault(call["index"], ["", ""])
                    got[0] += call["function"].get("name") or ""
                    got[1] += call["function"].get("arguments") or ""
                finish = choice["finish_reason"] or finish
    return [(name, arguments) for name, arguments in calls.values()], content, finish


@pytest.mark.parametrize("family", FAMILIES)
def test_a_forced_call_in_the_family_s_format_is_read_whole_and_streamed(gateway: GatewayThread, family: str) -> None:
    for seed, choice in ((1, "required"), (2, {"type": "function", "function": {"name": "get_weather"}})):
        request = body(family, seed=seed, tool_choice=choice)
        answer = httpx.post(f"{gateway.url}/v1/chat/completions", json=request, timeout=120)
        assert answer.status_code == 200, answer.text
        choice_out = answer.json()["choices"][0]
        message = choice_out["message"]
        assert choice_out["finish_reason"] == "tool_calls" and not message["content"], message
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMA if name == "get_weather" else {"type": "object"})
        if seed == 2:
            assert [name for name, _ in calls] == ["get_weather"]
        if family in ("glm", "gpt-oss"):
            assert message["reasoning_content"]
        assert streamed(gateway, request) == (calls, "", "tool_calls")


def test_responses_read_the_family_s_calls_as_function_calls(gateway: GatewayThread) -> None:
    answer = httpx.post(f"{gateway.url}/v1/responses", timeout=120, json={
        "model": "qwen3-coder", "input": ASK[0]["content"], "tool_choice": "required", "temperature": 1.0,
        "tools": [{"type": "function", **t["function"]} for t in TOOLS], "max_output_tokens": 300})
    assert answer.status_code == 200, answer.text
    calls = [item for item in answer.json()["output"] if item["type"] == "function_call"]
    assert calls and all(isinstance(json.loads(c["arguments"]), dict) for c in calls)


def test_messages_give_the_thinking_then_the_family_s_calls_as_tool_use_blocks(gateway: GatewayThread) -> None:
    request = {"model": "glm", "max_tokens": 300, "messages": ASK, "tool_choice": {"type": "any"}, "temperature": 1.0,
               "thinking": {"type": "enabled", "budget_tokens": 6},
               "tools": [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]}
    answer = httpx.post(f"{gateway.url}/v1/messages", json=request, timeout=120)
    assert answer.status_code == 200, answer.text
    blocks = answer.json()["content"]
    assert blocks[0]["type"] == "thinking" and blocks[0]["thinking"] and answer.json()["stop_reason"] == "tool_use"
    uses = [b for b in blocks if b["type"] == "tool_use"]
    assert uses and all(b["type"] in ("thinking", "tool_use") for b in blocks)
    for use in uses:
        jsonschema.validate(use["input"], SCHEMA if use["name"] == "get_weather" else {"type": "object"})
