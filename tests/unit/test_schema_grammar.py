"""The JSON-Schema compiler and the grammar checks (mpserve.structured): pure, no model.

Number ranges are checked exactly: their GBNF uses only literals, classes, groups, alternatives and
counted repetitions, which translate one to one into a Python regular expression."""

from __future__ import annotations

import functools
import itertools
import json
import re
import sys
import types
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest

from mpserve import structured
from mpserve.digit_ranges import integers
from mpserve.errors import BadRequest
from mpserve.wire import protocol as wire
from mpserve.wire.protocol import GenerateParams


def as_regex(gbnf: str) -> re.Pattern[str]:
    """A GBNF expression of literals, [classes], ( groups ), | and {m,n} as a regex."""
    out = []
    for token in re.finditer(r'"((?:\\.|[^"\\])*)"|(\[(?:\\.|[^\]\\])*\])|(\{\d*,?\d*\})|([()|])|(\s+)', gbnf):
        lit, cls, rep, punct, _ = token.groups()
        if lit is not None:
            out.append(re.escape(lit))
        elif cls is not None:
            out.append(cls)
        elif rep is not None:
            out.append(rep)
        elif punct == "(":
            out.append("(?:")
        elif punct:
            out.append(punct)
    return re.compile("".join(out))


@pytest.mark.parametrize("low, high", [(0, 0), (0, 9), (3, 7), (0, 120), (17, 4321), (-50, 50), (-999, -10),
                                       (-7, 0), (5, None), (None, -3), (None, 12), (-20, None), (99, 100)])
def test_integer_ranges_are_exact(low: int | None, high: int | None) -> None:
    pattern = as_regex(integers(low, high))
    for n in range(-1200, 5000):
        inside = (low is None or n >= low) and (high is None or n <= high)
        assert bool(pattern.fullmatch(str(n))) == inside, (low, high, n)
    assert not pattern.fullmatch("007") and not pattern.fullmatch("-0")


def number_rule(schema: dict[str, object]) -> re.Pattern[str]:
    grammar = structured.schema_grammar(json.dumps(schema))
    rules = dict(line.split(" ::= ", 1) for line in grammar.splitlines())
    body = rules[rules["root"]]
    return as_regex(body.removesuffix(" ws"))


@pytest.mark.parametrize("schema", [{"type": "number", "minimum": 0.5, "maximum": 9.5},
                                    {"type": "number", "exclusiveMinimum": -3, "exclusiveMaximum": 2},
                                    {"type": "number", "minimum": 10}, {"type": "integer", "maximum": 5}])
def test_bounded_numbers_stay_in_range(schema: dict[str, float]) -> None:
    pattern = number_rule(schema)
    for text in [f"{n / 4:g}" for n in range(-100, 200)] + ["3.141592", "0.000001", "9.4", "9.51", "-2.5"]:
        if pattern.fullmatch(text):
            value = float(text)
            assert value >= schema.get("minimum", -1e9) and value > schema.get("exclusiveMinimum", -1e9)
            assert value <= schema.get("maximum", 1e9) and value < schema.get("exclusiveMaximum", 1e9)
    assert pattern.fullmatch("1") or pattern.fullmatch("10") or pattern.fullmatch("-1")


@pytest.mark.parametrize("schema, words", [
    ({"type": "string", "oneOf": []}, "keyword 'oneOf' is not supported"),
    ({"type": "object", "properties": {"a": {"not": {}}}}, "at #/properties/a: keyword 'not' is not supported"),
    ({"allOf": [{}]}, "keyword 'allOf'"),
    ({"type": "array", "uniqueItems": True}, "keyword 'uniqueItems'"),
    ({"type": "integer", "multipleOf": 3}, "keyword 'multipleOf'"),
    ({"type": "strin"}, "'type' 'strin' is not one of"),
    ({"$ref": "https://example.com/s.json"}, "only references into this schema"),
    ({"$ref": "#/$defs/Missing"}, "points at nothing"),
    ({"type": "string", "format": "email"}, "string format 'email' is not supported"),
    ({"type": "string", "pattern": "(?=a)b"}, "a lookaround"),
    ({"type": "string", "pattern": "(a)\\1"}, "a backreference"),
    ({"type": "string", "pattern": "[a-"}, "not a valid regular expression"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "'maxItems' is less than 'minItems'"),
    ({"type": "string", "maxLength": 100000}, "'maxLength' over 256"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "no integer lies in the range"),
    ({"type": "number", "minimum": "0"}, "'minimum' must be a number"),
    ({"enum": []}, "'enum' must be a non-empty list"),
    ({"anyOf": [{"type": "null"}], "type": "string"}, "'anyOf' with type beside it"),
    ({"type": "object", "required": ["a"], "additionalProperties": False}, "no object matches"),
])
def test_unsupported_and_malformed_schemas_name_the_problem(schema: dict[str, object], words: str) -> None:
    with pytest.raises(BadRequest, match=re.escape(words)):
        structured.schema_grammar(json.dumps(schema))


def test_limits() -> None:
    deep: dict[str, object] = {"type": "integer"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    with pytest.raises(BadRequest, match="nests deeper than 32"):
        structured.schema_grammar(json.dumps(deep))
    wide = {"type": "object", "properties": {f"p{i}": {"enum": [f"v{j}" for j in range(40)]} for i in range(200)}}
    with pytest.raises(BadRequest, match="its grammar would be .*over the limit"):
        structured.schema_grammar(json.dumps(wide))
    with pytest.raises(BadRequest, match="nests parentheses 100 deep"):
        structured.check_grammar("root ::= " + "(" * 100 + '"a"' + ")" * 100)
    with pytest.raises(BadRequest, match="no 'root' rule"):
        structured.check_grammar('start ::= "a"')
    with pytest.raises(BadRequest, match=re.escape("repetition {2,1}, whose maximum is below its minimum")):
        structured.check_grammar('root ::= "a"{2,1}')  # llama.cpp would never finish expanding it
    with pytest.raises(BadRequest, match="repeats items 20000 times in all"):
        structured.check_grammar('root ::= "a"{10000} "b"{0,10000}')
    structured.check_grammar('root ::= "(((" [(] "{2,1}" # (((\n')  # parentheses in literals, classes, comments


def test_params_carry_one_of_grammar_and_schema_on_the_wire() -> None:
    schema = structured.canonical_json({"type": "object", "properties": {"a": {"type": "integer"}}})
    params = GenerateParams.from_wire({"json_schema": schema})
    assert params.json_schema == schema and params.grammar is None
    assert GenerateParams.from_wire({}).json_schema is None  # old clients send neither
    with pytest.raises(BadRequest, match="not both"):
        GenerateParams.from_wire({"json_schema": schema, "grammar": 'root ::= "a"'})
    with pytest.raises(BadRequest, match="field 'grammar' must be a string"):
        GenerateParams.from_wire({"grammar": 5})
    with pytest.raises(BadRequest, match="field 'json_schema' is longer than"):
        GenerateParams.from_wire({"json_schema": " " * (structured.MAX_SCHEMA_CHARS + 1)})
    with pytest.raises(BadRequest, match="'json_schema' must be a JSON object, got list"):
        GenerateParams.from_wire({"json_schema": "[]"})


# --- what a schema may cost (issue 59: a schema slow to compile stalled the gateway, then the broker) ------------

DEF = "D" * 48  # a $defs name past the 40 characters a rule's name keeps: every property's rule name collides


def defined(properties: int) -> str:
    """A schema whose root is a $ref to a definition of ``properties`` properties."""
    return structured.canonical_json({"$ref": f"#/$defs/{DEF}", "$defs": {DEF: {
        "type": "object", "properties": {f"p{i}": {} for i in range(properties)}}}})


class NoCompiling:
    def __init__(self, *args: object) -> None:
        raise AssertionError("the schema was compiled")


@pytest.mark.timeout(30)
def test_the_wire_check_refuses_too_many_properties_and_never_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker's decode and the gateway run GenerateParams' check: size and shape only; the worker compiles."""
    monkeypatch.setattr(structured, "_Compiler", NoCompiling)
    issue = defined(5800)
    with pytest.raises(BadRequest, match=r"'json_schema' has 5800 properties in all, over the limit of 1638"):
        GenerateParams.from_wire({"json_schema": issue})
    with pytest.raises(BadRequest, match="5800 properties"):  # the broker's decode of a REQUEST
        wire.decode([wire.VERSION, bytes([wire.MsgType.REQUEST]),
                     wire.pack({"id": "r", "prompt": "p", "params": {"json_schema": issue}})])
    with pytest.raises(BadRequest, match="5800 properties"):
        structured.schema_grammar(issue)  # the worker refuses it before compiling too
    unsupported = structured.canonical_json({"type": "object", "properties": {"a": {"not": {}}}})
    assert GenerateParams.from_wire({"json_schema": unsupported}).json_schema == unsupported
    assert isinstance(wire.decode([wire.VERSION, bytes([wire.MsgType.REQUEST]), wire.pack(
        {"id": "r", "prompt": "p", "params": {"json_schema": unsupported}})]), wire.Request)


def lines_run(call: Callable[[], object]) -> int:
    """How many lines of mpserve.structured ``call`` runs: its work, counted without a clock."""
    count = 0

    def local(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal count
        count += event == "line"
        return local

    def calls(frame: FrameType, event: str, arg: object) -> Any:
        return local if frame.f_code.co_filename == structured.__file__ else None

    before = sys.gettrace()
    sys.settrace(calls)
    try:
        call()
    finally:
        sys.settrace(before)
    return count


@pytest.mark.timeout(60)
def test_compiling_grows_linearly_with_properties_whose_rule_names_collide() -> None:
    small, large = (lines_run(functools.partial(structured.schema_grammar, defined(n))) for n in (80, 160))
    assert large < 2.5 * small, (small, large)  # it was quadratic: each name tried -2, -3, ... in turn


@pytest.mark.timeout(30)
def test_a_compile_past_its_time_budget_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = itertools.count(0.0, 0.25)  # each reading a quarter of a second later
    monkeypatch.setattr(structured, "time", types.SimpleNamespace(monotonic=lambda: next(clock)), raising=False)
    schema = structured.canonical_json({"type": "object", "properties": {f"q{i}": {"type": "integer"}
                                                                         for i in range(20)}})
    with pytest.raises(BadRequest, match=r"json_schema at #/properties/q\d+: compiling the schema took over 1 s"):
        structured.schema_grammar(schema)


@pytest.mark.timeout(30)
def test_a_refused_schema_is_refused_again_from_its_digest_without_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    schema = structured.canonical_json({"type": "object", "properties": {"refused-once": {"oneOf": []}}})
    with pytest.raises(BadRequest) as first:
        structured.schema_grammar(schema)
    monkeypatch.setattr(structured, "_Compiler", NoCompiling)
    with pytest.raises(BadRequest) as again:
        structured.schema_grammar(schema)
    assert again.value.message == first.value.message and "keyword 'oneOf'" in first.value.message
