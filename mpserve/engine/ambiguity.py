"""A GBNF grammar's ambiguity, measured before llama.cpp parses it: how many parse stacks one step may hold.

    GrammarCache.sampler(text), on a miss ──▶ ambiguity(text) ──▶ over MAX_AMBIGUITY: GrammarTooComplex (refused
                                                                   at admission, nothing parsed)

llama.cpp's grammar sampler keeps one stack per way the text so far can go on, and at each step it checks every
stack against every candidate token (``llama_grammar_reject_candidates``), so a step costs the vocabulary times the
stacks. Where a point of the grammar opens many alternatives that begin alike (an alternation of hundreds of
strings, a pattern's alternation), that many stacks live at once, and every step of the batch waits on them.

``ambiguity`` is the largest fan-out of the grammar: over every point of every rule and group (its start, and
after each element), the number of stacks llama.cpp makes when it advances from there, by expanding the rule references
and groups that come first (alternatives summed, an element that may match nothing letting the next one count
too). Rules are read from tokens as llama.cpp's parser reads them (strings, character classes, names, ``::=``,
``|``, parentheses and the repetition operators); what it could not parse, llama.cpp refuses after this. A
reference to a rule being expanded counts nothing (llama.cpp refuses left recursion), and counts stop at a cap
past the limit, so the measure is linear in the text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MAX_AMBIGUITY = 64
"""Parse stacks one step of a grammar may hold; the JSON grammars mpserve compiles from schemas hold far fewer."""

_TOKENS = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*|::=|[A-Za-z0-9_-]+|[|()*+?]'
                     r'|\{\s*(?P<low>\d*)\s*,?\s*\d*\s*\}|\S')


@dataclass
class _Group:
    """A rule's body or a parenthesised group: alternatives of elements (a str names a rule, a _Group nests, None
    is a terminal), and whether the group may match nothing (its repetition allows none)."""

    alternatives: list[list[str | _Group | None]] = field(default_factory=lambda: [[]])
    optional: bool = False


def ambiguity(text: str, cap: int = MAX_AMBIGUITY + 1) -> int:
    """The largest number of stacks one step of ``text``'s grammar may hold, counted up to ``cap`` (``cap`` too for
    references nested deeper than Python's recursion allows: a grammar no one writes by hand)."""
    try:
        return _Measure(_parse(text), cap).largest()
    except RecursionError:
        return cap


def _parse(text: str) -> dict[str, _Group]:
    """The rules of ``text`` by name (a later rule of the same name adds its alternatives, as llama.cpp's does)."""
    rules: dict[str, _Group] = {}
    tokens = [m for m in _TOKENS.finditer(text) if not m.group().startswith("#")]
    stack: list[_Group] = []
    for i, match in enumerate(tokens):
        token = match.group()
        if i + 1 < len(tokens) and tokens[i + 1].group() == "::=":
            continue  # the rule's name: the next token starts it
        if token == "::=":
            stack = [rules.setdefault(tokens[i - 1].group() if i else "", _Group([]))]
            stack[0].alternatives.append([])
        elif not stack:
            continue  # text before any rule: llama.cpp refuses it
        elif token == "|":
            stack[-1].alternatives.append([])
        elif token == "(":
            stack[-1].alternatives[-1].append(group := _Group())
            stack.append(group)
        elif token == ")":
            del stack[1:][-1:]
        elif token in ("*", "?") or (token.startswith("{") and match.group("low") in ("", "0")):
            _optional(stack[-1].alternatives[-1])
        elif token != "+" and not token.startswith("{"):  # at least once: the element as it is
            stack[-1].alternatives[-1].append(_element(token))
    return rules


def _element(token: str) -> str | _Group | None:
    """A rule's name as it is, a terminal as None, the empty string as a group that matches nothing."""
    if token == '""':
        return _Group(optional=True)
    return None if token[0] in '"[' else token


def _optional(sequence: list[str | _Group | None]) -> None:
    """The last element of ``sequence`` may now match nothing."""
    if not sequence:
        return
    last = sequence[-1]
    if isinstance(last, _Group):
        last.optional = True
    else:
        sequence[-1] = _Group([[last]], optional=True)


class _Measure:
    """Fan-outs of one grammar's rules and groups, each counted once (up to ``cap``)."""

    def __init__(self, rules: dict[str, _Group], cap: int) -> None:
        self._rules, self._cap = rules, cap
        self._fan: dict[int, int] = {}
        self._empty: dict[int, bool] = {}

    def largest(self) -> int:
        """The most stacks an advance makes from any point of any rule or group: its start, and after each element
        (its end returns: one stack)."""
        largest, seen, todo = 1, set(), list(self._rules.values())
        while todo and largest < self._cap:
            group = todo.pop()
            if id(group) not in seen:
                seen.add(id(group))
                largest = max(largest, self._fan_of(group))  # at its start: every alternative's
                for sequence in group.alternatives:
                    largest = max(largest, *self._suffixes(sequence, end=1))
                    todo += [e for e in sequence if isinstance(e, _Group)]
        return min(largest, self._cap)

    def _suffixes(self, sequence: list[str | _Group | None], end: int) -> list[int]:
        """Stacks an advance makes from each point of ``sequence`` (from its end last: ``end``, 1 where that returns
        to a caller, 0 inside an expansion, whose caller counts what follows)."""
        counts = [end]
        for element in reversed(sequence):
            group = self._rules.get(element) if isinstance(element, str) else element
            if group is None:  # a terminal (or an undefined rule, which llama.cpp refuses): one stack
                counts.append(1)
            else:
                counts.append(min(self._fan_of(group) + (counts[-1] if self._may_be_empty(group) else 0), self._cap))
        return counts[::-1]

    def _fan_of(self, group: _Group) -> int:
        key = id(group)
        if key not in self._fan:
            self._fan[key] = 0  # being expanded: a reference back to it counts nothing
            self._fan[key] = min(sum(self._suffixes(s, end=0)[0] for s in group.alternatives), self._cap)
        return self._fan[key]

    def _may_be_empty(self, group: _Group) -> bool:
        key = id(group)
        if key not in self._empty:
            self._empty[key] = False  # being asked: a reference back to it does not make it empty
            self._empty[key] = group.optional or any(all(self._empty_element(e) for e in s)
                                                     for s in group.alternatives)
        return self._empty[key]

    def _empty_element(self, element: str | _Group | None) -> bool:
        group = self._rules.get(element) if isinstance(element, str) else element
        return group is not None and self._may_be_empty(group)
