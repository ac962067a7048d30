"""Llama 3.1 to 3.3's tool calls: JSON objects with ``parameters``, the whole reply, optionally after
``<|python_tag|>``, several separated by ``;``.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

    text ──starts (after spaces) with <|python_tag|> or {──▶ object_call per object, ``;`` or spaces between
         ──otherwise──▶ content, never a call

Llama 3's prompt asks for the calls as the reply itself, so only a reply that begins with one is read as calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mpserve.structured import literal

from .base import Family, Partial, Tools, object_calls
from .gbnf import json_calls

TAG = "<|python_tag|>"


class Llama3(Family):
    name = "llama3"
    openers = (TAG, "{")
    anchored = True
    markers = (TAG, "ipython")

    def calls(self, section: str, final: bool, tools: Tools) -> list[Partial]:
        return object_calls(section.removeprefix(TAG), 0, " \t\r\n;")

    def grammar(self, tools: Sequence[tuple[str, Mapping[str, Any]]], many: int) -> str:
        return json_calls(tools, many, '{"name": "', literal('", "parameters": '), "}", "; ")
