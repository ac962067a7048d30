"""Reasoning through the HTTP gateway (``mpserve.gateway.api.reasoning``), on the built-in tiny model served with
the thinking ``qwen3`` template (model ``thinker``) and with ChatML (``plain``). Its random weights never close the
thinking: the budget does, to the token, in every API; the reply's thinking comes back apart from its answer,
whole and streamed alike; a JSON schema or a forced call holds after the thinking; thinking turned off gives none;
bad input is a 400 naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from gateway_thread import GatewayThread

pytestmark = pytest.mark.timeout(120)

N_CTX = 1024
R1_TEMPLATE = ("{% for m in messages %}{{ '<｜User｜>' + m['content'] }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\n' }}{% endif %}")
"""DeepSeek R1's way: the generation prompt opens the thinking (the history's thinking is never shown)."""
LOW, CLOSE = 6, "Time to answer."  # the thinker's budget for low effort, and its close message
ASK = [{"role": "user", "content": "What is two and two?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The server in front of conftest's ``gateway``: the tiny model as ``thinker`` (qwen3), ``plain`` (ChatML) and
    ``r1`` (a template whose generation prompt opens the thinking)."""
    from conftest import ServerProcess

    folder = tmp_path_factory.mktemp("reasoning")
    config, opening = folder / "models.yaml", folder / "r1.jinja"
    opening.write_text(R1_TEMPLATE)
    # reuse exact: a reply is the same whether its prompt was computed before or not (the comparisons of two)
    config.write_text("models:\n  - {name: thinker, path: builtin:tiny, chat_template: qwen3, parallel: 4, "
                      f"reuse: exact, n_ctx: {N_CTX}, reasoning: {{low: {LOW}, close: '{CLOSE}'}}}}\n"
                      f"  - {{name: plain, path: builtin:tiny}}\n  - {{name: r1, path: builtin:tiny, "
                      f"chat_template: {opening}}}\n")
    server = ServerProcess("--config", str(config)).wait_ready()
    yield server
    server.stop()


def chat(gateway: GatewayThread, **body: Any) -> dict[str, Any]:
    answer = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=60,
                        json={"model": "thinker", "messages": ASK, "temperature": 1.0, "seed": 3, **body})
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


def closing_tokens(gateway: GatewayThread) -> int:
    """The tokens a forced end takes (the close message, a newline, the end tag): the thinking of a budget of 0."""
    closed = chat(gateway, reasoning_budget=0, max_tokens=40, ignore_eos=True)
    assert closed["choices"][0]["message"]["reasoning_content"] == CLOSE  # only the closing tokens
    forced: int = closed["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert 0 < forced <= len(f"{CLOSE}\n</think>")
    return forced


def refused(gateway: GatewayThread, path: str, body: dict[str, Any]) -> str:
    answer = httpx.post(f"{gateway.url}{path}", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert "\n" not in error["message"]
    return str(error["message"])


def test_chat_thinks_within_its_budget_to_the_token_and_returns_the_thinking_apart(gateway: GatewayThread) -> None:
    forced = closing_tokens(gateway)
    for budget in (1, 9, 30):
        whole = chat(gateway, reasoning_budget=budget, max_tokens=60, ignore_eos=True)
        message, usage = whole["choices"][0]["message"], whole["usage"]
        assert usage["completion_tokens_details"]["reasoning_tokens"] == budget + forced
        assert message["reasoning_content"] and "think>" not in message["reasoning_content"] + message["content"]
        assert message["content"]


def test_an_effort_takes_the_model_s_configured_budget_closed_by_its_message(gateway: GatewayThread) -> None:
    whole = chat(gateway, reasoning_effort="low", max_tokens=60, ignore_eos=True)
    assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] == LOW + closing_tokens(gateway)
    assert whole["choices"][0]["message"]["reasoning_content"].endswith(CLOSE)


def test_a_streamed_reply_splits_as_the_whole_one(gateway: GatewayThread) -> None:
    body = {"model": "thinker", "messages": ASK, "temperature": 1.0, "seed": 5, "max_tokens": 50,
            "reasoning_budget": 20, "ignore_eos": True}
    whole = chat(gateway, **body)["choices"][0]["message"]
    parts: list[tuple[str, str]] = []
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    parts += [(key, choice["delta"][key]) for key in ("reasoning_content", "content")
                              if choice["delta"].get(key)]
    kinds = [key for key, _ in parts]
    assert kinds == sorted(kinds, reverse=True)  # all the thinking, then all the answer
    assert "".join(t for k, t in parts if k == "reasoning_content") == whole["reasoning_content"]
    assert "".join(t for k, t in parts if k == "content") == whole["content"]


def test_a_json_schema_and_a_forced_call_hold_after_the_thinking_for_many_seeds(gateway: GatewayThread) -> None:
    shape = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    for seed in (1, 5, 9, 13):  # 4 choices each, seeded seed + i
        for choice in chat(gateway, n=4, seed=seed, max_tokens=120, reasoning_budget=8,
                           response_format=shape)["choices"]:
            assert choice["message"]["reasoning_content"]
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    tool = {"type": "function", "function": {"name": "add", "parameters": SCHEMA}}
    called = chat(gateway, n=4, max_tokens=120, reasoning_budget=8, tools=[tool], tool_choice="required",
                  parallel_tool_calls=False)
    for choice in called["choices"]:
        assert choice["message"]["reasoning_content"] and choice["finish_reason"] == "tool_calls"
        [call] = choice["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)


def test_a_template_whose_prompt_opens_the_thinking_gets_it_apart_from_the_content(gateway: GatewayThread) -> None:
    whole = chat(gateway, model="r1", reasoning_budget=5, max_tokens=40, ignore_eos=True)
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] and "</think>" not in message["content"]
    assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] > 5


@pytest.mark.parametrize("off", [{"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}],
                         ids=["enable_thinking", "effort_none"])
def test_thinking_turned_off_gives_none(gateway: GatewayThread, off: dict[str, Any]) -> None:
    whole = chat(gateway, max_tokens=12, **off)
    assert "reasoning_content" not in whole["choices"][0]["message"]
    assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_reasoning_format_none_leaves_the_thinking_in_the_content(gateway: GatewayThread) -> None:
    whole = chat(gateway, max_tokens=30, reasoning_budget=4, ignore_eos=True, reasoning_format="none")
    assert "reasoning_content" not in whole["choices"][0]["message"]
    assert "</think>" in whole["choices"][0]["message"]["content"]


def test_bad_reasoning_input_is_a_400_naming_the_field(gateway: GatewayThread) -> None:
    path, base = "/v1/chat/completions", {"model": "thinker", "messages": ASK, "max_tokens": 4}
    assert "'reasoning_budget' must be a number of tokens, 0 or more" in refused(gateway, path, {
        **base, "reasoning_budget": -1})
    assert f"'reasoning_budget' = {N_CTX + 1} is more than the context holds" in refused(gateway, path, {
        **base, "reasoning_budget": N_CTX + 1})
    assert "'reasoning_effort' must be one of" in refused(gateway, path, {**base, "reasoning_effort": "extreme"})
    assert "'reasoning_format' must be one of" in refused(gateway, path, {**base, "reasoning_format": "xml"})
    assert "'reasoning_effort' asks for thinking, and this model's chat template does not think" in refused(
        gateway, path, {**base, "model": "plain", "reasoning_effort": "high"})


# --- Responses -------------------------------------------------------------------------------------------------

def respond(gateway: GatewayThread, **body: Any) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/responses", timeout=60, json={
        "model": "thinker", "input": "What is two and two?", "temperature": 1.0, "store": False, **body})


def events(gateway: GatewayThread, **body: Any) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{gateway.url}/v1/responses", timeout=60, json={
            "model": "thinker", "input": "What is two and two?", "temperature": 1.0, "store": False, "stream": True,
            **body}) as answer:
        return [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: ")]


def test_responses_answer_a_reasoning_item_within_the_budget_to_the_token(gateway: GatewayThread) -> None:
    forced = respond(gateway, reasoning_budget=0).json()["usage"]["output_tokens_details"]["reasoning_tokens"]
    assert forced == closing_tokens(gateway)
    whole = respond(gateway, reasoning_budget=11, max_output_tokens=40, reasoning={"effort": "low"}).json()
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == 11 + forced
    thought, said = whole["output"]
    assert thought["type"] == "reasoning" and thought["content"][0]["text"] and said["type"] == "message"
    assert whole["reasoning"] == {"effort": "low", "summary": None}
    streamed = events(gateway, reasoning_budget=11, max_output_tokens=40)
    deltas = [e["type"] for e in streamed if e["type"].endswith(".delta")]
    assert deltas == sorted(deltas, reverse=True) and "response.reasoning_text.delta" in deltas
    done = streamed[-1]["response"]
    assert [item["type"] for item in done["output"]] == ["reasoning", "message"]
    assert "".join(e["delta"] for e in streamed if e["type"] == "response.reasoning_text.delta") == \
        done["output"][0]["content"][0]["text"]


def test_responses_refuse_a_bad_effort_and_thinking_of_a_model_that_does_not_think(gateway: GatewayThread) -> None:
    body = {"model": "thinker", "input": "hi"}
    assert "'reasoning.effort' must be one of" in refused(gateway, "/v1/responses", {
        **body, "reasoning": {"effort": "max"}})
    assert "'reasoning.effort' asks for thinking" in refused(gateway, "/v1/responses", {
        **body, "model": "plain", "reasoning": {"effort": "high"}})
    assert respond(gateway, reasoning={"effort": "none"}, max_output_tokens=4).json()["output"][0]["type"] == "message"


# --- Messages --------------------------------------------------------------------------------------------------

def message(gateway: GatewayThread, **body: Any) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/messages", timeout=60, json={
        "model": "thinker", "max_tokens": 40, "messages": ASK, "temperature": 1.0, **body})


def test_messages_think_in_a_signed_block_within_the_budget_to_the_token(gateway: GatewayThread) -> None:
    whole = message(gateway, thinking={"type": "enabled", "budget_tokens": 13}, temperature=0.0).json()
    thought, said = whole["content"]
    assert thought["type"] == "thinking" and thought["thinking"] and thought["signature"]
    assert said["type"] == "text"
    # Anthropic's usage does not count the thinking apart: the same greedy reply through chat does
    same = chat(gateway, reasoning_budget=13, max_tokens=40, temperature=0.0)
    assert same["choices"][0]["message"]["reasoning_content"] == thought["thinking"]
    assert same["usage"]["completion_tokens_details"]["reasoning_tokens"] == 13 + closing_tokens(gateway)
    with httpx.stream("POST", f"{gateway.url}/v1/messages", timeout=60, json={
            "model": "thinker", "max_tokens": 40, "messages": ASK, "temperature": 1.0, "stream": True,
            "thinking": {"type": "enabled", "budget_tokens": 13}}) as answer:
        streamed = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: ")]
    starts = [e["content_block"]["type"] for e in streamed if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = [e["delta"] for e in streamed if e["type"] == "content_block_delta"]
    thinking = "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta")
    [signature] = [d["signature"] for d in deltas if d["type"] == "signature_delta"]
    history = [*ASK, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": thinking, "signature": signature}, {"type": "text", "text": "Four."}]},
        {"role": "user", "content": "And three and three?"}]
    assert message(gateway, messages=history, thinking={"type": "disabled"}).json()["content"][0]["type"] == "text"


def test_messages_refuse_bad_thinking_naming_the_field(gateway: GatewayThread) -> None:
    body = {"model": "thinker", "max_tokens": 4, "messages": ASK}
    assert "'thinking.budget_tokens' must be a number of tokens, 0 or more" in refused(gateway, "/v1/messages", {
        **body, "thinking": {"type": "enabled", "budget_tokens": -5}})
    assert "'thinking' must be" in refused(gateway, "/v1/messages", {**body, "thinking": {"type": "sometimes"}})
    assert "'thinking' asks for thinking, and this model's chat template does not think" in refused(
        gateway, "/v1/messages", {**body, "model": "plain", "thinking": {"type": "enabled", "budget_tokens": 9}})


def test_the_anthropic_sdk_takes_the_signed_thinking_and_sends_it_back_unchecked(gateway: GatewayThread) -> None:
    """The SDK parses the thinking block and gathers the streamed signature into it; a thinking block sent back
    is dropped from the conversation with its signature unread, so a forged one changes nothing."""
    import anthropic

    client = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0)
    kw: Any = dict(model="thinker", max_tokens=40, messages=ASK, thinking={"type": "enabled", "budget_tokens": 9},
                   extra_body={"temperature": 0.0})
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    thought, said = whole.content
    assert isinstance(thought, anthropic.types.ThinkingBlock) and isinstance(said, anthropic.types.TextBlock)
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert thought.thinking and thought.signature
    follow: Any = [{"role": "user", "content": "And three and three?"}]
    kw |= dict(thinking={"type": "disabled"}, max_tokens=12)

    def after(block: dict[str, Any]) -> str:
        history = [*ASK, {"role": "assistant", "content": [block, said.model_dump()]}, *follow]
        return client.messages.create(**{**kw, "messages": history}).content[0].text  # type: ignore[union-attr]

    assert after(thought.model_dump()) == after({**thought.model_dump(), "signature": "forged"}) == \
        client.messages.create(**{**kw, "messages": [*ASK, {"role": "assistant", "content": [said.model_dump()]},
                                                     *follow]}).content[0].text  # type: ignore[union-attr]
