"""GLM 4.5's, 4.6's and 4.7's tool calls: the function's name after ``<tool_call>``, then each argument as an
``<arg_key>`` and its ``<arg_value>``.

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

    text ──up to the first <tool_call>──▶ content
         ──each <tool_call> NAME (up to a newline or <arg_key>)──▶ the name, then xml.Pairs: each argument as its
           value closes, ``}`` at </tool_call>

A string argument is its raw text; any other is read as JSON. Its thinking is ``<think>`` ... ``</think>``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from .base import Family, Partial, Tools
from .gbnf import keyed_calls
from .xml import Pairs

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PAIRS = Pairs("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", CLOSE, trim_newline=False)
NAME_END = re.compile(r"\n|<arg_key>|</tool_call>")


class Glm(Family):
    name = "glm"
    openers = (OPEN,)
    markers = ("<arg_key>",)

    def calls(self, section: str, final: bool, tools: Tools) -> list[Partial]:
        out = []
        for piece in section.split(OPEN)[1:]:
            end = NAME_END.search(piece)
            if end is None:
                if final:
                    out.append(Partial(None, "", True))
                break
            name, body = piece[:end.start()].strip(), piece[end.start():]
            out.append(PAIRS.call(name, body, final, tools.get(name)))
        return out

    def grammar(self, tools: Sequence[tuple[str, Mapping[str, Any]]], many: int) -> str:
        return keyed_calls(tools, many, OPEN, "\n", lambda key, value: (
            f'"<arg_key>" {key} "</arg_key>\\n<arg_value>" {value} "</arg_value>\\n"'), CLOSE)
