"""Qwen3-Coder's tool calls (and Qwen 3.5's): XML-like, one ``<parameter=KEY>`` per argument, its value raw text.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

    text ──up to the first <tool_call> (or <function=)──▶ content
         ──each <function=NAME>──▶ the name, then xml.Pairs: each parameter as it closes, ``}`` at </function>

A string parameter is its raw text (one newline after the tag and one before the closing tag are the format's);
any other is read as JSON. A forced call writes a plain string parameter without ``<`` (it could otherwise close
early), any other as the JSON its schema allows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import Family, Partial, Tools
from .gbnf import keyed_calls
from .xml import Pairs

OPEN, FUNCTION = "<tool_call>", "<function="
PAIRS = Pairs("<parameter=", ">", "", "</parameter>", "</function>", trim_newline=True)


class Qwen3Coder(Family):
    name = "qwen3-coder"
    openers = (OPEN, FUNCTION)
    markers = (FUNCTION, "<parameter=")

    def calls(self, section: str, final: bool, tools: Tools) -> list[Partial]:
        out = []
        for piece in section.split(FUNCTION)[1:]:
            name, marker, body = piece.partition(">")
            if not marker:
                if final:
                    out.append(Partial(None, "", True))
                break
            out.append(PAIRS.call(name.strip(), body, final, tools.get(name.strip())))
        return out

    def grammar(self, tools: Sequence[tuple[str, Mapping[str, Any]]], many: int) -> str:
        return keyed_calls(tools, many, OPEN + "\n" + FUNCTION, ">\n", lambda key, value: (
            f'"<parameter=" {key} ">\\n" {value} "\\n</parameter>\\n"'), "</function>\n</tool_call>")
