"""gpt-oss's Harmony format: a reply is messages, each a header (its channel, and for a call its recipient) and a
body. Thinking is the ``analysis`` channel, the answer the ``final`` one, and a call a message to
``functions.NAME``, its body the arguments' JSON, ended by ``<|call|>``.

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>                                          (one line in a reply)
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

    text ──each header (<|start|>... or <|channel|>..., up to <|message|>) and body (up to <|end|>, <|call|>,
           <|return|> or the next <|start|>)──▶ a recipient ``to=`` in the header: a call, the body its arguments
                                              ──▶ no channel, or final: content;  analysis or commentary: neither
         text before the first header ──▶ content;  a message from another role (a tool's answer) ──▶ neither

Calls are read on any channel: the model writes them on ``analysis`` too, not only ``commentary``. The header is
read loosely: ``to=`` before or after the channel, ``<|constrain|>json`` or plain ``json`` or neither, spaces
or none. A forced call is written as the format says (commentary, ``<|constrain|>json``), one per reply:
``<|call|>`` ends gpt-oss's turn.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from mpserve.structured import literal

from .base import Family, Partial, Scan, Tools, held_back, json_arguments
from .gbnf import Rules, alternatives

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", START)
HEADERS = (START, CHANNEL)
RECIPIENT = re.compile(r"to=(?:functions\.)?([A-Za-z0-9_-]+)")
ROLE = re.compile(r"<\|start\|>\s*([^\s<]+)")
CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z]+)")


class Harmony(Family):
    name = "gpt-oss"
    openers = HEADERS
    markers = (CHANNEL, "<|constrain|>")
    thinking = (CHANNEL + "analysis" + MESSAGE, "<|end|>")
    channels = True

    def scan(self, text: str, final: bool, tools: Tools) -> Scan:
        content, calls, i, seen = "", list[Partial](), 0, False
        while True:
            found = [j for j in (text.find(h, i) for h in HEADERS) if j >= 0]
            if not found:
                if not seen:
                    content += text[i:] if final else text[i:len(text) - held_back(text, HEADERS)]
                return Scan(content, tuple(calls))
            header_at = min(found)
            content += "" if seen else text[i:header_at]
            seen = True
            body_at = text.find(MESSAGE, header_at)
            if body_at < 0:
                if final and RECIPIENT.search(text, header_at):
                    calls.append(Partial(None, "", True))
                return Scan(content, tuple(calls))
            header, body_at = text[header_at:body_at], body_at + len(MESSAGE)
            ends = [j for j in (text.find(e, body_at) for e in ENDS) if j >= 0]
            end = min(ends) if ends else None
            body = text[body_at:end] if end is not None or final else text[body_at:len(text) - held_back(text, ENDS)]
            recipient = RECIPIENT.search(header)
            if (role := ROLE.match(header)) is not None and role.group(1) != "assistant":
                pass  # another's message (a tool's answer): neither a call nor content
            elif recipient is not None:
                arguments, closed = json_arguments(body, 0)
                calls.append(Partial(recipient.group(1), arguments, closed is not None or end is not None or final))
            elif (channel := CHANNEL_NAME.search(header)) is None or channel.group(1) == "final":
                content += body
            if end is None:
                return Scan(content, tuple(calls))
            i = end if text.startswith(START, end) else end + len(next(e for e in ENDS if text.startswith(e, end)))

    def grammar(self, tools: Sequence[tuple[str, Mapping[str, Any]]], many: int) -> str:
        rules = Rules()
        choice = alternatives(tools, lambda name, parameters: (
            f"{literal(name + ' <|constrain|>json' + MESSAGE)} {rules.schema(parameters)}"))
        return rules.grammar(f'{literal(START + "assistant")}? {literal(CHANNEL + "commentary to=functions.")} '
                             f'{choice} {literal("<|call|>")}')
