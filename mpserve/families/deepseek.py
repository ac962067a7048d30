"""DeepSeek V3.1's and later tool calls (V3.1, V3.2, R1-0528's successors): each call its name, a separator token
and the arguments' JSON, between the calls' begin and end tokens.

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>
    <｜tool▁calls▁end｜>                                                (one line in a reply)

    text ──up to <｜tool▁calls▁begin｜>──▶ content
         ──each <｜tool▁call▁begin｜> NAME <｜tool▁sep｜>──▶ the name, then the arguments' object as it forms

V3.0's form (``function<｜tool▁sep｜>NAME`` and the arguments in a json code block) is not read. Its thinking is
``<think>`` ... ``</think>`` as R1's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mpserve.structured import literal

from .base import Family, Partial, Tools, named_calls
from .gbnf import json_calls

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


class DeepSeek(Family):
    name = "deepseek-v3"
    openers = (BEGIN, CALL)
    markers = (BEGIN, CALL)

    def calls(self, section: str, final: bool, tools: Tools) -> list[Partial]:
        return named_calls(section.split(CALL)[1:], SEP, final)

    def grammar(self, tools: Sequence[tuple[str, Mapping[str, Any]]], many: int) -> str:
        return json_calls(tools, many, CALL, literal(SEP), CALL_END, "", head=BEGIN, tail=END)
