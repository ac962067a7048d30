"""Kimi K2's tool calls: each call's id (``functions.NAME:INDEX``), then its arguments' JSON, in a calls section.

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>      (one line in a reply)

    text ──up to <|tool_calls_section_begin|>──▶ content
         ──each <|tool_call_begin|> ID <|tool_call_argument_begin|>──▶ the name (the id without ``functions.``
           and ``:INDEX``), then the arguments' object as it forms
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mpserve.structured import literal

from .base import Family, Partial, Tools, named_calls
from .gbnf import json_calls

BEGIN, END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL, ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


class Kimi(Family):
    name = "kimi"
    openers = (BEGIN, CALL)
    markers = (BEGIN, CALL)

    def calls(self, section: str, final: bool, tools: Tools) -> list[Partial]:
        return named_calls(section.split(CALL)[1:], ARGS, final, _name)

    def grammar(self, tools: Sequence[tuple[str, Mapping[str, Any]]], many: int) -> str:
        return json_calls(tools, many, CALL + "functions.", f'{literal(":")} [0-9] {literal(ARGS)}', CALL_END, "",
                          head=BEGIN, tail=END)


def _name(ident: str) -> str:
    """The function's name in a call's id, ``functions.NAME:INDEX``."""
    return (ident.strip().rpartition(":")[0] or ident.strip()).removeprefix("functions.")
