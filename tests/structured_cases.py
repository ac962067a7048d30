"""JSON Schemas that constrained completions are checked against (tests/test_structured.py and the
gateway's tests): nested objects, arrays, enums, numbers with ranges, optional and required properties,
anyOf and $ref. Strings are bounded, so that the random-weight models close them within MAX_TOKENS."""

from __future__ import annotations

from typing import Any

MAX_TOKENS = 320
PROMPT = "Reply in JSON:"

NAME = {"type": "string", "maxLength": 10}
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 1, "maxItems": 4},
    {"enum": ["red", "green", "blue"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": 0.5, "maximum": 9.5}}, "required": ["x"]},
    {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "uuid"},
    {"$defs": {"P": {"type": "object", "properties": {"v": {"type": "boolean"}}, "required": ["v"]}},
     "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"]},
    {"anyOf": [{"type": "null"}, {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 7}]},
    {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}, "b": {"type": "integer", "minimum": 0,
                                                                                      "maximum": 9}}},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999}, "tags": {"type": "array", "items": NAME,
                                                                             "maxItems": 3}},
        "required": ["id", "tags"], "additionalProperties": False}}, "required": ["user"],
     "additionalProperties": False},
    {"type": "array", "items": {"enum": [1, "two", None, True]}, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"kind": {"const": "point"}, "xy": {"type": "array", "items": {
        "type": "number", "minimum": -1, "maximum": 1}, "minItems": 2, "maxItems": 2}}, "required": ["kind", "xy"]},
    {"type": ["integer", "null"], "minimum": 10, "maximum": 20},
    {"type": "boolean"},
    {"type": "object", "properties": {"when": {"type": "string", "format": "time"},
                                      "level": {"enum": ["low", "high"]}}, "required": ["level"]},
    {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                                         "next": {"anyOf": [{"$ref": "#/$defs/node"},
                                                                            {"type": "null"}]}},
                        "required": ["v", "next"]}}, "$ref": "#/$defs/node"},
    {"type": "string", "minLength": 3, "maxLength": 8},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^(ab|cd)+x?$"},
                                      "n": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 100}},
     "required": ["code", "n"]},
    {"type": "object", "title": "Pydantic-like", "properties": {
        "title": {"title": "Title", "type": "string", "maxLength": 12},
        "score": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "null"}], "default": None}},
     "required": ["title"]},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"enum": ["a", "b"]},
                                                                 "v": {"type": "integer", "maximum": 3,
                                                                       "minimum": -3}},
                                "required": ["k", "v"]}, "maxItems": 3},
    {"type": "number", "minimum": -5.5, "maximum": 1000},
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "^\\d{2}[a-f]{1,4}\\.$"}}, "required": ["s"]},
]
