"""Each template family's tool calls (``mpserve.families``) against replies written by hand from the formats:
read whole, and streamed split at every position (the pieces add up to the whole reading); tricky content (a
``</think>`` in a JSON string, XML-like text, quotes and newlines in a parameter's value); Harmony's calls on the
analysis channel and under malformed headers; a forced reply cut short."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mpserve.families import FAMILIES, for_template, read, read_forced
from mpserve.families.stream import CallStream

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                  "required": ["city"]}
TOOLS: dict[str, dict[str, Any]] = {"get_weather": WEATHER_SCHEMA, "get_time": {"type": "object"},
                                    "write": {"type": "object", "properties": {"text": {"type": "string"}}}}
PARIS = ("get_weather", {"city": "Paris"})
PARIS3 = ("get_weather", {"city": "Paris", "days": 3})
NOW = ("get_time", {})
DS_CALL, DS_SEP, DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
KIMI = "<|tool_call_begin|>functions.{}:{}<|tool_call_argument_begin|>{}<|tool_call_end|>"
HARMONY = "<|start|>assistant<|channel|>{} to=functions.{} <|constrain|>json<|message|>{}<|call|>"
TRICKY = "a </think> and <b>\"quoted\"</b>\nsecond line"

CASES: list[tuple[str, str, str, list[tuple[str, dict[str, Any]]]]] = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "", [PARIS]),
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>\n<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>', "Let me look.",
     [PARIS3, NOW]),
    ("hermes", '<tool_call>{"name": "write", "arguments": {"text": ' + json.dumps(TRICKY) + "}}</tool_call>", "",
     [("write", {"text": TRICKY})]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "{}"}', "", [NOW]),
    ("qwen3-coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
                    "</parameter>\n</function>\n</tool_call>", "", [PARIS3]),
    ("qwen3-coder", "Sure.\n<tool_call>\n<function=write>\n<parameter=text>\n" + TRICKY.replace("</think>", "<x=1>")
     + "\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
     "Sure.", [("write", {"text": TRICKY.replace("</think>", "<x=1>")}), NOW]),
    ("gpt-oss", HARMONY.format("commentary", "get_weather", '{"city": "Paris"}'), "", [PARIS]),
    ("gpt-oss", HARMONY.format("analysis", "get_weather", '{"city": "Paris"}'), "", [PARIS]),  # analysis channel
    ("gpt-oss", '<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{"city": "Paris"}<|call|>',
     "", [PARIS]),  # no <|constrain|>
    ("gpt-oss", '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}',
     "", [PARIS]),  # the recipient before the channel, plain json, no <|call|> at the end
    ("gpt-oss", HARMONY.format("commentary", "get_time", "{}") + "<|start|>functions.get_time to=assistant"
                "<|channel|>commentary<|message|>{}<|end|>", "", [NOW]),  # a tool's answer is no call
    ("gpt-oss", "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hot."
                "<|return|>", "Hot.", []),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
               '{"name": "get_time", "parameters": {}}', "", [PARIS, NOW]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {}}]', "", [PARIS, NOW]),
    ("mistral", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', "Checking.",
     [PARIS, NOW]),
    ("gemma", '```tool_code\nget_weather(city="Paris", days=3)\n```', "", [PARIS3]),
    ("gemma", 'Here.\n```tool_code\n[get_weather(city="Paris"), get_time()]\n```', "Here.", [PARIS, NOW]),
    ("deepseek-v3", "<｜tool▁calls▁begin｜>" + DS_CALL + "get_weather" + DS_SEP + '{"city": "Paris"}' + DS_END
     + DS_CALL + "get_time" + DS_SEP + "{}" + DS_END + "<｜tool▁calls▁end｜>", "", [PARIS, NOW]),
    ("glm", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
            "<arg_value>3</arg_value>\n</tool_call>", "", [PARIS3]),
    ("glm", "Writing.<tool_call>write\n<arg_key>text</arg_key>\n<arg_value>" + TRICKY + "<arg_value></arg_value>\n"
            "</tool_call>", "Writing.", [("write", {"text": TRICKY + "<arg_value>"})]),
    ("kimi", "<|tool_calls_section_begin|>" + KIMI.format("get_weather", 0, '{"city": "Paris"}')
     + KIMI.format("get_time", 1, "{}") + "<|tool_calls_section_end|>", "", [PARIS, NOW]),
    ("json", '```json\n{"tool_calls": [{"function": {"name": "get_time", "arguments": "{}"}}]}\n```', "", [NOW]),
]
MALFORMED = [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Par</tool_call>'),
    ("hermes", '<tool_call>{"name": "delete_everything", "arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>'),
    ("qwen3-coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>"),
    ("glm", "<tool_call>get_weather\n<arg_key>city</arg_key>Paris</tool_call>"),
    ("gpt-oss", "<|channel|>commentary to=functions.get_weather <|constrain|>json"),
    ("gemma", "```tool_code\nget_weather(city=open('x'))\n```"),
    ("kimi", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"),
    ("llama3", "The weather is nice."),
]


def calls_of(found: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(f.name, json.loads(f.arguments)) for f in found]


@pytest.mark.parametrize(("family", "text", "content", "calls"), CASES)
def test_a_family_reads_its_own_calls(family: str, text: str, content: str, calls: list[Any]) -> None:
    found = read(FAMILIES[family], text, TOOLS)
    if not calls:
        assert found is None or found == (content, [])
        return
    assert found is not None and found[0] == content and calls_of(found[1]) == calls


def streamed(family: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[Any] | None]:
    stream, content, calls = CallStream(FAMILIES[family], TOOLS), "", []
    deltas = [d for piece in pieces for d in stream.push(piece)]
    end, found = stream.finish()
    for d in deltas + end:
        content += d.content
        if d.name is not None:
            assert d.index == len(calls)
            calls.append((d.name, ""))
        elif d.index >= 0:
            calls[d.index] = (calls[d.index][0], calls[d.index][1] + d.arguments)
    return content, calls, found


@pytest.mark.parametrize(("family", "text", "content", "calls"), [c for c in CASES if c[3]])
def test_split_at_every_position_a_stream_adds_up_to_the_whole_reading(family: str, text: str, content: str,
                                                                       calls: list[Any]) -> None:
    whole = read(FAMILIES[family], text, TOOLS)
    assert whole is not None
    expected = [(f.name, f.arguments) for f in whole[1]]
    for cut in range(len(text) + 1):
        got_content, got, found = streamed(family, [text[:cut], text[cut:]])
        assert (got_content.strip(), got) == (content, expected), cut
        assert found == whole[1]
    assert streamed(family, list(text))[:2][1] == expected  # a character at a time


def test_calls_stream_as_they_form() -> None:
    text = CASES[1][1]
    stream, seen = CallStream(FAMILIES["hermes"], TOOLS), []
    for i in range(len(text)):
        seen += [(i, d) for d in stream.push(text[i])]
    named = [i for i, d in seen if d.name == "get_weather"]
    arguments = [i for i, d in seen if d.index == 0 and d.arguments]
    assert named and len(arguments) > 5 and named[0] < arguments[0] < text.index("</tool_call>")


@pytest.mark.parametrize(("family", "text"), MALFORMED)
def test_a_malformed_call_is_no_call(family: str, text: str) -> None:
    assert read(FAMILIES[family], text, TOOLS) is None
    assert streamed(family, [text])[2] is None


def test_prose_streams_as_content_and_only_what_may_open_a_call_is_held() -> None:
    stream = CallStream(FAMILIES["hermes"], TOOLS)
    assert [d.content for d in stream.push("It is <tool")] == ["It is "]
    assert [d.content for d in stream.push("s> here")] == ["<tools> here"]


@pytest.mark.parametrize(("template", "family"), [
    ("", "hermes"), ("{{ '<tool_call>' }}", "hermes"), ("<|channel|>analysis", "gpt-oss"),
    ("<tool_call>\n<function=", "qwen3-coder"), ("<tool_call>{{ name }}<arg_key>", "glm"),
    ("<|tool_calls_section_begin|>", "kimi"), ("<｜tool▁calls▁begin｜>", "deepseek-v3"), ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3"), ("```tool_code", "gemma"), ("{{ m.content }}", "json")])
def test_the_family_follows_the_template(template: str, family: str) -> None:
    assert for_template(template).name == family


def test_a_forced_reply_cut_short_is_its_complete_calls() -> None:
    text = CASES[1][1]
    found, cut = read_forced(FAMILIES["hermes"], text[:text.rindex('"get_time"')], TOOLS)
    assert calls_of(found) == [PARIS3] and cut
    found, cut = read_forced(FAMILIES["hermes"], text, TOOLS)
    assert calls_of(found) == [PARIS3, NOW] and not cut
