"""The JSON-Schema compiler and the grammar checks (mpserve.structured): pure, no model.

Number ranges are checked exactly: their GBNF uses only literals, classes, groups, alternatives and
counted repetitions, which translate one to one into a Python regular expression."""

from __future__ import annotations

import json
import re

import pytest

from mpserve import structured
from mpserve.errors import BadRequest
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
    pattern = as_regex(structured._integers(low, high))
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
    with pytest.raises(BadRequest, match="its grammar would be .* over the limit"):
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
