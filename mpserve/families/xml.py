"""What the XML-like families (Qwen3-Coder, GLM) share: a call's parameters read one by one, each a key and a raw
value, and their arguments written as JSON as the parameters close.

    ``<KEY-OPEN>key<KEY-CLOSE>...value<VALUE-CLOSE>`` pairs ──Pairs.read──▶ [(key, raw value)], closed or not
        ──arguments──▶ ``{"key": value, ...`` (``}`` once the call closes): a string property's raw text as a JSON
          string, any other's value read as JSON (raw text if it is not)

A value is the text up to its closing tag, so it may hold other tags, quotes and newlines; only the closing tag
itself cannot be in it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .base import Partial


@dataclass(frozen=True)
class Pairs:
    """A family's parameter syntax: ``key_open`` KEY ``key_close`` [spaces ``value_open``] VALUE ``value_close``,
    and the call's end."""

    key_open: str
    key_close: str
    value_open: str
    value_close: str
    call_end: str
    trim_newline: bool  # a value's one leading and one trailing newline are the format's, not the value's

    def read(self, body: str, final: bool) -> tuple[list[tuple[str, str]], bool, bool]:
        """The closed parameters of ``body`` (after the call's name), whether the call closed, and whether its text
        broke the syntax."""
        pairs: list[tuple[str, str]] = []
        i = 0
        while True:
            while i < len(body) and body[i] in " \t\r\n":
                i += 1
            rest = body[i:]
            if rest.startswith(self.call_end):
                return pairs, True, False
            if not rest.startswith(self.key_open):
                broken = bool(rest) and not (self.key_open.startswith(rest) or self.call_end.startswith(rest))
                return pairs, final, broken or (final and bool(rest))
            key_end = body.find(self.key_close, i)
            start = self._value_start(body, key_end + len(self.key_close)) if key_end >= 0 else None
            value_end = body.find(self.value_close, start) if start is not None else -1
            if start == -1 or value_end < 0:
                return pairs, final, final or start == -1
            key = body[i + len(self.key_open):key_end]
            value = body[start:value_end]
            if self.trim_newline:
                value = value.removeprefix("\n").removesuffix("\n")
            pairs.append((key.strip(), value))
            i = value_end + len(self.value_close)

    def _value_start(self, body: str, i: int) -> int | None:
        """Where the value after a key's closing tag (at ``i``) begins; None: not yet known, -1: no value opens."""
        if not self.value_open:
            return i
        rest = body[i:].lstrip()
        if rest.startswith(self.value_open):
            return len(body) - len(rest) + len(self.value_open)
        return None if self.value_open.startswith(rest) else -1

    def call(self, name: str | None, body: str, final: bool, parameters: Mapping[str, Any] | None) -> Partial:
        pairs, closed, broken = self.read(body, final)
        if broken:
            return Partial(None, "", True)
        properties = (parameters or {}).get("properties")
        properties = properties if isinstance(properties, Mapping) else {}
        items = [f"{json.dumps(k, ensure_ascii=False)}: {_value(v, properties.get(k))}" for k, v in pairs]
        return Partial(name, "{" + ", ".join(items) + ("}" if closed else ""), closed)


def _value(raw: str, schema: Any) -> str:
    """A raw value as JSON text: a string property's as a string; else the value read as JSON, if it is."""
    types = schema.get("type") if isinstance(schema, Mapping) else None
    if types == "string" or (isinstance(types, list) and "string" in types and not _is_json(raw)):
        return json.dumps(raw, ensure_ascii=False)
    return raw.strip() if _is_json(raw) else json.dumps(raw, ensure_ascii=False)


def _is_json(raw: str) -> bool:
    try:
        json.loads(raw)
    except ValueError:
        return False
    return True
