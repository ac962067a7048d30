"""A template family's tool calls: what every family shares, and the shape of a reply's calls as they form.

    a reply's text (whole, or what has come so far) ──Family.scan──▶ Scan: the content before the first call,
        and each call so far (Partial: its name once known, its arguments' JSON text so far, done or not)
                                    │
                 ┌──────────────────┴───────────────────┐
    read / read_forced (the whole reply: the calls)   CallStream (``stream``: deltas as the calls form)

A family says where a call section may open (``openers``; ``anchored``: only at the start of the reply) and reads
the section (``calls``). The arguments of a call so far are always a prefix of its final arguments, so a stream
can send them as they grow and its pieces add up to what the whole reply reads. ``final``: the text is the whole
reply, so a marker's first characters at its end are text, not a marker still to come.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

Tools = Mapping[str, Mapping[str, Any]]
"""The functions a request offers: each name with its parameters' JSON Schema."""


@dataclass(frozen=True)
class Partial:
    """One call as far as the text goes: ``name`` None until it is known; ``arguments`` the JSON text so far."""

    name: str | None
    arguments: str
    done: bool


@dataclass(frozen=True)
class Scan:
    content: str
    calls: tuple[Partial, ...]


@dataclass(frozen=True)
class Found:
    """A complete call: the function's name and its arguments, the JSON text of an object."""

    name: str
    arguments: str


class Family:
    """A template family: its name, where its thinking starts and ends (None: it does not think), how its calls
    open, how they read (``calls``) and the grammar that writes one (``grammar``)."""

    name: ClassVar[str]
    openers: ClassVar[tuple[str, ...]]
    anchored: ClassVar[bool] = False
    thinking: ClassVar[tuple[str, str] | None] = None
    markers: ClassVar[tuple[str, ...]] = ()
    """Text only this family's chat templates write, by which a template is recognised (``for_template``)."""
    channels: ClassVar[bool] = False
    """Its replies are messages with headers (Harmony): the content is the answer's messages, never raw text."""

    def content(self, text: str) -> str:
        """A whole reply's content when it holds no call: the text itself, or the answer's messages in it."""
        return self.scan(text, True, {}).content.strip() if self.channels else text

    def scan(self, text: str, final: bool, tools: Tools) -> Scan:
        start = self.section_start(text, final)
        return Scan(text[:start], tuple(self.calls(text[start:], final, tools)) if start < len(text) else ())

    def section_start(self, text: str, final: bool) -> int:
        """Where the calls begin: the first opener; else the end of the text, less what may begin one."""
        if self.anchored:
            body = text.lstrip()
            begins = any(body.startswith(o) or (not final and o.startswith(body)) for o in self.openers)
            return len(text) - len(body) if begins else len(text)
        found = [i for i in (text.find(o) for o in self.openers) if i >= 0]
        if found:
            return min(found)
        return len(text) if final else len(text) - held_back(text, self.openers)

    def calls(self, section: str, final: bool, tools: Tools) -> list[Partial]:
        """The calls of ``section``, which begins with one of the openers."""
        raise NotImplementedError

    def grammar(self, tools: Sequence[tuple[str, Mapping[str, Any]]], many: int) -> str:
        """GBNF writing 1 to ``many`` calls of ``tools`` (name, parameters) in this family's format."""
        raise NotImplementedError


def held_back(text: str, markers: Sequence[str]) -> int:
    """How many characters at the end of ``text`` may be the start of one of ``markers``."""
    return max((n for m in markers for n in range(min(len(m) - 1, len(text)), 0, -1) if m.startswith(text[-n:])),
               default=0)


def read(family: Family, text: str, tools: Tools) -> tuple[str, list[Found]] | None:
    """The content and the calls of a whole reply; None when it holds none, or one that is not complete, names a
    function not offered or whose arguments are not a JSON object (the reply is then plain content)."""
    scan = family.scan(text, True, tools)
    found = [_complete(p, tools) for p in scan.calls]
    if not found or any(f is None for f in found):
        return None
    return scan.content.strip(), [f for f in found if f is not None]


def read_forced(family: Family, text: str, tools: Tools) -> tuple[list[Found], bool]:
    """The calls of a reply its grammar made calls, and whether it ends in one cut short (max_tokens): that one,
    and any that is not well formed, is left out."""
    calls = family.scan(text, True, tools).calls
    found = [f for f in (_complete(p, tools) for p in calls) if f is not None]
    return found, not calls or not calls[-1].done


def _complete(call: Partial, tools: Tools) -> Found | None:
    if not call.done or call.name not in tools:
        return None
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        return None
    return Found(call.name, call.arguments) if isinstance(arguments, dict) and call.name is not None else None


# --- reading pieces of a call ---------------------------------------------------------------------

_OUTSIDE = re.compile(r'[^"\\{}\[\]]*')  # what a JSON value's structure skips: all but quotes, brackets, escapes
_INSIDE = re.compile(r'[^"\\]*')  # a string's plain characters
_SCANNED: OrderedDict[tuple[int, str], tuple[str, int, int, bool]] = OrderedDict()
"""Where json_end stopped in a text that did not end its value: (start, its first characters) -> (the text, the
index it stopped at, the depth, inside a string). A stream reads its text again with each piece, one piece longer:
the scan goes on from where it stopped, so a long value costs its length once, not once per piece."""
SCANS_KEPT = 256


def json_end(text: str, start: int) -> int | None:
    """The index after the JSON object, array or string that begins at ``text[start]``; None if it does not end
    in ``text``. Runs of plain characters are skipped by regular expressions."""
    key = (start, text[start:start + 64])
    i, depth, quoted = start, 0, False
    if (kept := _SCANNED.get(key)) is not None and text.startswith(kept[0]):
        i, depth, quoted = kept[1:]
    end, i, depth, quoted = _scan(text, i, depth, quoted)
    if end is None:
        _SCANNED[key] = (text, i, depth, quoted)
        _SCANNED.move_to_end(key)
        while len(_SCANNED) > SCANS_KEPT:
            _SCANNED.popitem(last=False)
    return end


def _scan(text: str, i: int, depth: int, quoted: bool) -> tuple[int | None, int, int, bool]:
    """json_end from ``i`` in the given state: the end (None if not in ``text``), and where and in which state it
    stopped (before a character that may change the state: an escape at the end of the text is left to redo)."""
    n = len(text)
    while i < n:
        if quoted:
            j = _skip(_INSIDE, text, i)
            if j >= n or (text[j] == "\\" and j + 1 >= n):
                return None, j, depth, True
            if text[j] == "\\":
                i = j + 2  # an escape and the character it escapes
                continue
            i, quoted = j + 1, False
            if depth == 0:
                return i, i, depth, False
            continue
        i = _skip(_OUTSIDE, text, i)
        if i >= n:
            break
        c = text[i]
        if c == '"':
            quoted = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth <= 0:
                return i + 1, i + 1, depth, False
        i += 1
    return None, i, depth, quoted


def _skip(run: re.Pattern[str], text: str, i: int) -> int:
    """The index after the run of ``run``'s characters at ``text[i]`` (which may be empty)."""
    found = run.match(text, i)
    return found.end() if found else i


def json_arguments(text: str, start: int) -> tuple[str, int | None]:
    """The arguments object that begins at ``text[start]`` (after spaces): its text so far and the index after
    it (None while it goes on). Arguments written as a JSON string of an object come whole once the string ends."""
    while start < len(text) and text[start] in " \t\r\n":
        start += 1
    if start >= len(text):
        return "", None
    end = json_end(text, start)
    if text[start] == "{":
        return text[start:end], end
    if end is None:
        return "", None
    try:
        value = json.loads(text[start:end])
    except ValueError:
        return text[start:end], end
    return (value if isinstance(value, str) else text[start:end]), end


def named_calls(pieces: list[str], marker: str, final: bool,
                name_of: Callable[[str], str] = str.strip) -> list[Partial]:
    """Calls written NAME ``marker`` ARGUMENTS, one a piece: the name (``name_of`` the text before the marker) once the
    marker is there, then the arguments' object as it forms."""
    out = []
    for piece in pieces:
        head, found, rest = piece.partition(marker)
        if not found:
            if final:
                out.append(Partial(None, "", True))
            break
        arguments, end = json_arguments(rest, 0)
        out.append(Partial(name_of(head), arguments, end is not None or final))
    return out


def object_calls(body: str, i: int, between: str) -> list[Partial]:
    """Calls written as JSON objects (``object_call``) from ``body[i]`` on, ``between`` characters between them, up to
    the end of ``body`` or a ``]``."""
    out: list[Partial] = []
    while True:
        while i < len(body) and body[i] in between:
            i += 1
        if i == len(body) or body[i] == "]":
            return out
        if body[i] != "{":
            return [*out, Partial(None, "", True)]
        call, end = object_call(body, i)
        out.append(call)
        if end is None:
            return out
        i = end


def object_call(text: str, start: int) -> tuple[Partial, int | None]:
    """A call written as a JSON object, ``{"name": ..., "arguments": {...}}`` (or ``"parameters"``), that begins
    at ``text[start]``: the call so far, and the index after its object (None while it goes on)."""
    end = json_end(text, start)
    body = text[start:end]
    if end is not None:
        try:
            value = json.loads(body)
        except ValueError:
            return Partial(None, "", True), end
        if not isinstance(value, dict):
            return Partial(None, "", True), end
    name = _string_field(body, "name")
    arguments = ""
    for key in ("arguments", "parameters"):
        at = _field_at(body, key)
        if at is not None:
            arguments, closed = json_arguments(body, at)
            if end is not None and closed is None:
                return Partial(name, "", True), end
            break
    else:
        if end is not None:
            arguments = "{}"
    return Partial(name, arguments, end is not None), end


def _field_at(body: str, key: str) -> int | None:
    """Where the value of ``key`` begins in a JSON object's text (at its top level, by a plain search)."""
    marker = f'"{key}"'
    i = body.find(marker)
    while i >= 0:
        j = i + len(marker)
        while j < len(body) and body[j] in " \t\r\n":
            j += 1
        if j < len(body) and body[j] == ":":
            return j + 1
        i = body.find(marker, i + 1)
    return None


def _string_field(body: str, key: str) -> str | None:
    at = _field_at(body, key)
    if at is None:
        return None
    while at < len(body) and body[at] in " \t\r\n":
        at += 1
    end = json_end(body, at) if at < len(body) and body[at] == '"' else None
    if end is None:
        return None
    value = json.loads(body[at:end])
    return value if isinstance(value, str) else None
