"""Mistral's tool calls, in both forms its templates teach: a JSON list after ``[TOOL_CALLS]`` (7B v0.3, Nemo),
or each call as ``[TOOL_CALLS]NAME[ARGS]{...}`` (the templates since v11: Small 3.x, Magistral, Devstral).

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

    text ──up to the first [TOOL_CALLS]──▶ content
         ──a list──▶ object_call per element;  NAME[ARGS]──▶ the name (a [CALL_ID]... after it skipped), the
           arguments' object as it forms

A forced call is written in the second form, the newer templates'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mpserve.structured import literal

from .base import Family, Partial, Tools, named_calls, object_calls
from .gbnf import json_calls

MARK, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


class Mistral(Family):
    name = "mistral"
    openers = (MARK,)
    markers = (MARK,)

    def calls(self, section: str, final: bool, tools: Tools) -> list[Partial]:
        body = section.removeprefix(MARK)
        if body.lstrip().startswith("["):
            return object_calls(body, body.index("[") + 1, " \t\r\n,")
        return named_calls(body.split(MARK), ARGS, final, lambda name: name.partition(CALL_ID)[0].strip())

    def grammar(self, tools: Sequence[tuple[str, Mapping[str, Any]]], many: int) -> str:
        return json_calls(tools, many, MARK, literal(ARGS), "", "")

