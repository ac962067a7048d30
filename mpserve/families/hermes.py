"""Hermes' and Qwen 2.5 / 3's tool calls: a JSON object in ``<tool_call>`` tags, one per call.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

    text ──up to the first <tool_call>──▶ content
         ──each <tool_call> ... (</tool_call> or the end)──▶ object_call: its name, its arguments as they form

The ChatML default and every template that writes ``<tool_call>`` (mpserve's tools prompt teaches it too). A call
left open at the end of the reply counts once its object is complete (models often stop before the closing tag).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mpserve.structured import literal

from .base import Family, Partial, Tools, object_call
from .gbnf import json_calls

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Hermes(Family):
    name = "hermes"
    openers = (OPEN,)
    markers = (OPEN,)

    def calls(self, section: str, final: bool, tools: Tools) -> list[Partial]:
        out = []
        for piece in section.split(OPEN)[1:]:
            start = len(piece) - len(piece.lstrip())
            if start < len(piece) and piece[start] == "{":
                out.append(object_call(piece, start)[0])
            elif final or start < len(piece):  # not a JSON object: a malformed call
                out.append(Partial(None, "", True))
        return out

    def grammar(self, tools: Sequence[tuple[str, Mapping[str, Any]]], many: int) -> str:
        return json_calls(tools, many, OPEN + '\n{"name": "', literal('", "arguments": '), "}\n" + CLOSE, "\n")
