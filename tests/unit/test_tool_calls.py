"""Tool calls (mpserve.gateway.api.tools and the chat shapes in mpserve.gateway.api.openai): the parsers on outputs
of each model family, written by hand from the formats' documentation, malformed ones included (plain
content, never an error); the tools prompt of the ChatML default; forced calls constrained by a grammar in the
family's format; streamed calls sent as they form."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest

from mpserve.client import Result
from mpserve.errors import BadRequest
from mpserve.gateway.api import openai as oai
from mpserve.gateway.api import tools as tc
from mpserve.gateway.api.chat import Renderer
from mpserve.wire import protocol as wire
from mpserve.wire.protocol import ChatTemplate

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Now", "parameters": {"type": "object"}}}]
SPEC = tc.parse_tools(TOOLS, None, None)
assert SPEC is not None
WEATHER = ("get_weather", {"city": "Paris"})
TIME = ("get_time", {})

WELL_FORMED: list[tuple[tc.Parser, str, str, list[tuple[str, dict[str, Any]]]]] = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "", [WEATHER]),
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me look.", [WEATHER, TIME]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "{}"}', "", [TIME]),  # unterminated at EOS
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [WEATHER]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
               '{"name": "get_time", "parameters": {}}', "", [WEATHER, TIME]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [WEATHER]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', "", [WEATHER, TIME]),
    ("json", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [WEATHER]),
    ("json", '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}] ',
     "", [WEATHER, TIME]),
    ("json", '```json\n{"tool_calls": [{"function": {"name": "get_time", "arguments": "{}"}}]}\n```', "", [TIME]),
    ("hermes", '{"name": "get_time", "arguments": {}}', "", [TIME]),  # the generic parser after the family's
]
MALFORMED: list[tuple[tc.Parser, str]] = [
    ("hermes", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par</tool_call>"),
    ("hermes", '<tool_call>{"name": "delete_everything", "arguments": {}}</tool_call>'),  # not offered
    ("hermes", '<tool_call>{"name": "get_time", "arguments": [1, 2]}</tool_call>'),  # arguments not an object
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>oops</tool_call>'),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}; trailing'),
    ("llama3", "The weather is nice."),
    ("mistral", "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": "),
    ("mistral", "[TOOL_CALLS]get_weather{\"city\": \"Paris\"}"),
    ("json", '{"name": "get_time", "arguments": "{not json"}'),
    ("json", '{"answer": 42}'), ("json", "[]"), ("json", ""), ("json", "null"),
]


@pytest.mark.parametrize("parser, text, content, calls", WELL_FORMED)
def test_each_family_s_calls_are_parsed(parser: tc.Parser, text: str, content: str,
                                        calls: list[tuple[str, dict[str, Any]]]) -> None:
    got_content, got = tc.parse_calls(text, parser, SPEC.tools)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got) and len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("parser, text", MALFORMED)
def test_a_malformed_call_is_plain_content(parser: tc.Parser, text: str) -> None:
    assert tc.parse_calls(text, parser, SPEC.tools) == (text, [])
    call = oai.parse("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
    reply = oai.Reply(call, "m").whole([result(text)])
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert reply["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("template, parser", [("", "hermes"), ("{{ '<tool_call>' }}", "hermes"),
                                              ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3"),
                                              ("{% for m in messages %}{{ m.content }}{% endfor %}", "json")])
def test_the_parser_follows_the_template(template: str, parser: str) -> None:
    assert tc.parser_for(template) == parser


def result(text: str, finish: str = "stop") -> Result:
    return Result("r", text, finish, wire.Usage(3, 4), wire.Timings(), "w")


def streamed(call: oai.Call, pieces: list[str]) -> list[dict[str, Any]]:
    reply = oai.Reply(call, "m")
    chunks = [c for piece in pieces for c in reply.chunks(piece)]
    return chunks + reply.last([result("".join(pieces))], {})


def test_a_streamed_auto_reply_is_held_while_it_may_be_a_call() -> None:
    call = oai.parse("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "stream": True})
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    chunks = streamed(call, [text[:3], text[3:20], text[20:]])
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant" and deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                                           "arguments": ""}
    assert json.loads(deltas[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    prose = streamed(call, ["  The", " weather", " is fine"])
    assert [c["choices"][0]["delta"].get("content") for c in prose] == ["  The", " weather", " is fine", None]
    assert prose[-1]["choices"][0]["finish_reason"] == "stop"
    broken = streamed(call, ["<tool_", "call>{oops"])
    assert broken[0]["choices"][0]["delta"]["content"] == "<tool_call>{oops"



def test_each_of_n_streamed_choices_is_read_on_its_own() -> None:
    call = oai.parse("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "stream": True,
                              "n": 2})
    text = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    reply = oai.Reply(call, "m")
    chunks = [*reply.chunks(text[:5], None, 0), *reply.chunks(" Hello", None, 1), *reply.chunks(text[5:], None, 0)]
    deltas = [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks]
    assert deltas[0] == (1, {"role": "assistant", "content": " Hello"})  # choice 0 is held back, 1 streams as prose
    assert [i for i, _ in deltas[1:]] == [0, 0] and deltas[1][1]["role"] == "assistant"
    assert deltas[1][1]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    assert deltas[2][1]["tool_calls"][0] == {"index": 0, "function": {"arguments": "{}"}}
    last = reply.last([result(text), dataclasses.replace(result(" Hello"), index=1)], {})
    assert [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in last] == [(0, "tool_calls"),
                                                                                           (1, "stop")]
    whole = oai.Reply(call, "m").whole([result(text), dataclasses.replace(result(" Hello"), index=1)])
    assert [c["finish_reason"] for c in whole["choices"]] == ["tool_calls", "stop"]
    assert whole["choices"][1]["message"] == {"role": "assistant", "content": " Hello"}


def test_forced_choices_constrain_with_a_grammar_of_the_family_s_calls() -> None:
    named = oai.parse("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                               "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert named.params.grammar is None and named.params.json_schema is None  # until the template's family is known
    grammar = _templated(named, ChatTemplate()).params.grammar or ""
    assert grammar.startswith("root ::= call\n")
    assert '"<tool_call>\\x0A{\\x22name\\x22: \\x22" ( "get_weather"' in grammar and "get_time" not in grammar
    required = oai.parse("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                                  "tool_choice": "required"})
    grammar = _templated(required, ChatTemplate()).params.grammar or ""
    assert f"{{0,{tc.MAX_PARALLEL_CALLS - 1}}}" in grammar and "get_weather" in grammar and "get_time" in grammar
    none = oai.parse("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "none"})
    assert none.tools is None and _templated(none, ChatTemplate()).params.grammar is None
    with pytest.raises(BadRequest, match="cannot be combined"):
        oai.parse("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                           "tool_choice": "required", "response_format": {"type": "json_object"}})


def test_required_without_parallel_calls_allows_exactly_one_call() -> None:
    one = oai.parse("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                             "tool_choice": "required", "parallel_tool_calls": False})
    assert (_templated(one, ChatTemplate()).params.grammar or "").startswith("root ::= call\n")  # no repetition


def test_a_tool_schema_the_grammar_cannot_hold_is_a_400_naming_it() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "not": {"const": "a"}}}}}}]
    call = oai.parse("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                              "tool_choice": "required"})
    with pytest.raises(BadRequest, match=r"] tools\[0\] \(f\): .*keyword 'not' is not supported"):
        _templated(call, ChatTemplate())


def test_a_template_s_family_writes_the_forced_grammar() -> None:
    forced = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "required"}
    harmony = _templated(oai.parse("chat", forced), ChatTemplate("<|start|>{{ m }}<|channel|>final<|message|>"))
    assert harmony.parser == "gpt-oss" and "to=functions." in (harmony.params.grammar or "")
    plain = _templated(oai.parse("chat", forced), ChatTemplate())
    assert plain.parser == "hermes" and "<tool_call>" in (plain.params.grammar or "")
    bare = _templated(oai.parse("chat", {**forced, "stream": True}),
                      ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}"))
    assert bare.parser == "json" and "<tool_call>" in (bare.params.grammar or "")  # the tools prompt's format
    text = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    message = oai.Reply(bare, "m").whole([result(text)])["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
    deltas = [c["choices"][0]["delta"] for c in streamed(bare, [text[:9], text[9:]]) if c["choices"]]
    assert [d["tool_calls"][0]["function"].get("name") for d in deltas if d.get("tool_calls")] == ["get_time", None]


CALL_TEXT = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'
BOTH = CALL_TEXT.format("get_weather", '{"city": "Paris"}') + "\n" + CALL_TEXT.format("get_time", "{}")


@pytest.mark.parametrize(("text", "calls", "cut"), [
    (BOTH, [WEATHER, TIME], False),
    (CALL_TEXT.format("get_time", "{}"), [TIME], False),
    (BOTH[:-20], [WEATHER], True),
    (BOTH[:BOTH.index("\n<tool_call>")], [WEATHER], False),
    (BOTH[:40], [], True),
    ("<tool_", [], True),
])
def test_a_forced_reply_is_its_complete_calls_even_when_cut(text: str, calls: list[Any], cut: bool) -> None:
    found, was_cut = tc.forced_calls(text, "hermes", SPEC.tools)
    assert [(c.name, json.loads(c.arguments)) for c in found] == calls and was_cut is cut


def test_a_cut_forced_reply_is_never_content_whole_or_streamed() -> None:
    call = oai.parse("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                              "tool_choice": "required", "stream": True})
    text = BOTH[:-25]
    result = Result("r", text, "length", wire.Usage(3, 20), wire.Timings(), "w0")
    message = oai.Reply(call, "tiny").whole([result])["choices"][0]
    assert message["finish_reason"] == "length" and not message["message"]["content"]
    assert [c["function"]["name"] for c in message["message"]["tool_calls"]] == ["get_weather"]
    reply = oai.Reply(call, "tiny")
    chunks = reply.chunks(text[:30]) + reply.chunks(text[30:]) + reply.last([result], {})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not any(d.get("content") for d in deltas)
    names = [d["tool_calls"][0]["function"].get("name") for d in deltas if d.get("tool_calls")]
    assert names == ["get_weather", None, "get_time"]  # the cut call streamed as far as it went: its name
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
               "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]


def _templated(call: oai.Call, chat: ChatTemplate) -> oai.Call:
    renderer = Renderer()
    try:
        return asyncio.run(call.with_chat_template(chat, renderer, "m"))
    finally:
        renderer.close()


RESULTS_TURN = "The tool get_weather returned: 18 C\nUsing this, answer: Weather in Paris?"
"""HISTORY's tool result as templates without tools get it: the call's function named, the question asked again."""


def test_the_chatml_default_renders_tools_and_a_tool_s_result_as_a_user_turn_without_the_call() -> None:
    for tools in (TOOLS, None):
        call = _templated(oai.parse("chat", {"messages": HISTORY, "tools": tools}), ChatTemplate())
        assert call.prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n" if tools else
                                      "<|im_start|>system\nBe brief.<|im_end|>\n")
        assert ('{"type": "function", "function": {"name": "get_weather"' in call.prompt) == bool(tools)
        assert call.prompt.endswith(f"<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
                                    f"<|im_end|>\n<|im_start|>user\n{RESULTS_TURN}<|im_end|>\n"
                                    "<|im_start|>assistant\n")
    parallel = [*HISTORY[:2], {**HISTORY[2], "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": "{}"}}
        for i, name in enumerate(["get_weather", "get_time"])]},
        *({"role": "tool", "tool_call_id": f"call_{i}", "content": text} for i, text in enumerate(["18 C", "9:42"]))]
    assert _templated(oai.parse("chat", {"messages": parallel, "tools": TOOLS}), ChatTemplate()).prompt.endswith(
        "<|im_start|>user\nThe tool get_weather returned: 18 C\nThe tool get_time returned: 9:42\n"
        "Using this, answer: Weather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_gets_the_tools_variable_or_the_default_prompt() -> None:
    with_tools = ChatTemplate("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                              "{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
                              "<{{ c.function.arguments.city }}>{% endfor %};{% endfor %}")
    call = _templated(oai.parse("chat", {"messages": HISTORY, "tools": TOOLS}), with_tools)
    assert call.prompt == "[get_weather][get_time]system:Be brief.;user:Weather in Paris?;assistant:<Paris>;tool:18 C;"
    plain = ChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}")
    call = _templated(oai.parse("chat", {"messages": HISTORY, "tools": TOOLS}), plain)
    assert call.prompt.startswith("system:Be brief.\n\n# Tools\n") and call.parser == "json"
    assert call.prompt.endswith(f";user:Weather in Paris?;assistant:;user:{RESULTS_TURN};")


HARMONY_REPLY = ("The user wants weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
                 '<|constrain|>json<|message|>{"city": "Paris"}<|call|>')


SUNNY = "The user wants weather.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny."


@pytest.mark.parametrize(("text", "content", "calls", "tools"), [
    (HARMONY_REPLY, None, [WEATHER], TOOLS), (SUNNY, "It is sunny.", [], TOOLS), (SUNNY, "It is sunny.", [], None)])
def test_harmony_thinks_on_the_analysis_channel_and_answers_on_the_final_one_whole_and_streamed(
        text: str, content: str | None, calls: list[Any], tools: list[Any] | None) -> None:
    call = dataclasses.replace(oai.parse("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                                  "stream": True}), parser="gpt-oss", reasoning_end="<|end|>")
    message = oai.Reply(call, "m").whole([result(text)])["choices"][0]["message"]
    assert message["reasoning_content"] == "The user wants weather." and message["content"] == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in
            message.get("tool_calls", [])] == calls
    for cut in range(0, len(text), 7):
        deltas = [c["choices"][0]["delta"] for c in streamed(call, [text[:cut], text[cut:]]) if c["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants weather."
        assert "".join(d.get("content") or "" for d in deltas) == (content or "")
        assert "".join(d["tool_calls"][0]["function"].get("arguments", "") for d in deltas if d.get("tool_calls")) \
            == "".join(c["function"]["arguments"] for c in message.get("tool_calls", []))
