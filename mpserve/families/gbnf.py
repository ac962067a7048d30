"""GBNF for forced calls: each tool's arguments compiled from its JSON Schema (``mpserve.structured``), the rules
of all the tools in one grammar, and a family's calls around them.

    tools (name, parameters) ──Rules.schema──▶ structured.schema_grammar per schema ──▶ its rules renamed
        (``t<N>-``: each schema's own; the base rules, ws, string, ..., shared) ──▶ Rules
    Rules + a family's call (Rules.root, alternatives, repeated) ──▶ one GBNF text, root first

A family writes its calls' fixed text as literals around a choice of the functions (``alternatives``: each one's
name, then its arguments), repeated up to the calls a reply may hold (``repeated``). Families whose arguments are
not a JSON object (XML parameters, Python keywords) take each property's value apart (``Rules.properties``): a
plain string as raw text, anything else as its JSON.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mpserve.structured import canonical_json, literal, schema_grammar

Tool = tuple[str, Mapping[str, Any]]
_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[A-Za-z][A-Za-z0-9-]*')
_PLAIN_STRING_KEYS = frozenset({"type", "description", "title", "default", "examples", "minLength", "maxLength"})


class Rules:
    """The rules of one grammar, by name."""

    def __init__(self) -> None:
        self._rules: dict[str, str] = {}
        self._schemas = 0

    def schema(self, schema: Mapping[str, Any]) -> str:
        """The name of a rule writing the JSON that ``schema`` allows (its own rules renamed, the base shared)."""
        prefix = f"t{self._schemas}-"
        self._schemas += 1
        for line in schema_grammar(canonical_json(dict(schema))).splitlines():
            name, _, body = line.partition(" ::= ")
            if _own(name):
                self._rules[prefix + name] = _TOKEN.sub(lambda m: _renamed(m.group(), prefix), body)
            else:
                self._rules[name] = body
        return prefix + "root"

    def add(self, name: str, body: str) -> str:
        self._rules[name] = body
        return name

    def properties(self, parameters: Mapping[str, Any], raw_strings: bool) -> list[tuple[str, str, bool]]:
        """Each property of ``parameters``: its name, the rule writing its value and whether it is required,
        the required first. ``raw_strings``: a plain string property is written as raw text, not JSON (within its
        minLength and maxLength; without ``<``, which could close its tag early)."""
        properties = parameters.get("properties")
        if not isinstance(properties, Mapping):
            return []
        required = [p for p in parameters.get("required", []) if p in properties]
        defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
        out = []
        for name in [*required, *(p for p in properties if p not in required)]:
            prop = properties[name]
            if raw_strings and _plain_string(prop):
                low, high = prop.get("minLength", 0), prop.get("maxLength")
                value = self.add(f"raw-text-{low}-{high}", f"[^<]{{{low},{'' if high is None else high}}}"
                                 if low or high is not None else "[^<]*")
            elif raw_strings and isinstance(prop, Mapping) and prop.get("type") == "string" and "enum" in prop:
                value = "( " + " | ".join(literal(str(v)) for v in prop["enum"]) + " )"
            else:
                value = self.schema({**(prop if isinstance(prop, Mapping) else {}), **defs})
            out.append((name, value, name in required))
        return out

    def grammar(self, root: str) -> str:
        rules = {"root": root, **{k: v for k, v in self._rules.items() if k != "root"}}
        return "\n".join(f"{name} ::= {body}" for name, body in rules.items()) + "\n"


def _own(name: str) -> bool:
    """A rule of the schema itself (``root`` and its paths' ``r...``), not a base rule shared by all."""
    return name == "root" or name.startswith("r")


def _renamed(token: str, prefix: str) -> str:
    return prefix + token if token[0] not in '"[' and _own(token) else token


def _plain_string(prop: Any) -> bool:
    return isinstance(prop, Mapping) and prop.get("type") == "string" and set(prop) <= _PLAIN_STRING_KEYS


def alternatives(tools: Sequence[Tool], one: Callable[[str, Mapping[str, Any]], str]) -> str:
    """A choice of one call of each tool: ``one(name, parameters)`` writes it."""
    return "( " + " | ".join(one(name, parameters) for name, parameters in tools) + " )"


def repeated(call: str, separator: str, many: int) -> str:
    """``call`` once, then up to ``many`` - 1 more, each after ``separator`` (a GBNF expression)."""
    return call if many <= 1 else f"{call} ( {separator} {call} ){{0,{many - 1}}}"


def parameters_sequence(rules: Rules, parameters: Mapping[str, Any], raw_strings: bool,
                        one: Callable[[str, str], str], separator: str = "") -> str:
    """The properties of ``parameters`` in order, each written by ``one(literal name, value rule)``: the required
    ones always, then each optional one or not; ``separator`` (a literal) between two, when given."""
    items = [(one(literal(name), value), required)
             for name, value, required in rules.properties(parameters, raw_strings)]
    sep = f"{literal(separator)} " if separator else ""

    def after(first: int) -> str:  # item ``first``, then each later one after the separator
        rest = [f"{sep}{item}" if required else f"( {sep}{item} )?" for item, required in items[first + 1:]]
        return " ".join([items[first][0], *rest])

    if not items:
        return '""'
    if not separator:
        return " ".join(item if required else f"( {item} )?" for item, required in items)
    if items[0][1]:
        return after(0)
    return "( " + " | ".join(after(i) for i in range(len(items))) + " )?"


def json_calls(tools: Sequence[Tool], many: int, before: str, between: str, after: str, separator: str,
               head: str = "", tail: str = "") -> str:
    """GBNF of ``head``, 1 to ``many`` calls written ``before`` NAME ``between`` ARGUMENTS ``after`` (the arguments
    the JSON of the tool's parameters; ``between`` a GBNF expression, the others literal text), ``separator``
    between two calls, then ``tail``."""
    rules = Rules()
    choice = alternatives(tools, lambda name, parameters: f"{literal(name)} {between} {rules.schema(parameters)}")
    call = rules.add("call", f"{literal(before)} {choice} {literal(after)}")
    return rules.grammar(" ".join(filter(None, (head and literal(head), repeated(call, literal(separator), many),
                                                tail and literal(tail)))))


def keyed_calls(tools: Sequence[Tool], many: int, before: str, after_name: str, pair: Callable[[str, str], str],
                after: str) -> str:
    """GBNF of 1 to ``many`` calls written ``before`` NAME ``after_name``, each argument as ``pair(key, value)``
    writes it (a plain string's value raw text), then ``after``; a newline between two calls."""
    rules = Rules()

    def one(name: str, parameters: Mapping[str, Any]) -> str:
        return f"{literal(name + after_name)} {parameters_sequence(rules, parameters, True, pair)}"

    call = rules.add("call", f"{literal(before)} {alternatives(tools, one)} {literal(after)}")
    return rules.grammar(repeated(call, literal("\n"), many))
