"""Gemma's tool calls: a Python call in a ``tool_code`` code block, keywords for the arguments.

    ```tool_code
    get_weather(city="Paris", days=3)
    ```

    text ──up to the first ```tool_code──▶ content
         ──each block, once it closes (or the reply ends)──▶ its calls: one a line, or a list of them
           ([f(a=1), g()], the pythonic form), each keyword's value a Python or JSON literal

Gemma 3 has no tool format of its own in its chat template: Google's function-calling guide has the model write
Python calls, and its cookbook puts them in a ``tool_code`` block, the form Gemma's fine-tunes and prompts use
most; a JSON call would be the generic parser's. A block is read once it closes, so its arguments come whole, not
piece by piece. A forced call writes the keywords' values as JSON (a valid Python literal but for true, false and
null, which are read too).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from typing import Any

from mpserve.structured import literal

from .base import Family, Partial, Tools
from .gbnf import Rules, alternatives, parameters_sequence, repeated

OPEN, CLOSE = "```tool_code", "```"
NAMED = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


class Gemma(Family):
    name = "gemma"
    openers = (OPEN,)
    markers = ("tool_code",)

    def calls(self, section: str, final: bool, tools: Tools) -> list[Partial]:
        out: list[Partial] = []
        for piece in section.split(OPEN)[1:]:
            code, closed, _ = piece.partition(CLOSE)
            if not closed and not final:
                break
            out += _calls(code)
        return out

    def grammar(self, tools: Sequence[tuple[str, Mapping[str, Any]]], many: int) -> str:
        rules = Rules()

        def one(name: str, parameters: Mapping[str, Any]) -> str:
            keywords = parameters_sequence(rules, parameters, False, lambda key, value: (
                f'{key[:-1]}=" {value}'), separator=", ")
            return f'{literal(name + "(")} {keywords} ")"'

        call = rules.add("call", alternatives(tools, one))
        return rules.grammar(f'{literal(OPEN + chr(10))} {repeated(call, literal(chr(10)), many)} '
                             f'{literal(chr(10) + CLOSE)}')


def _calls(code: str) -> list[Partial]:
    """The calls of a block: one a line, or a list of them."""
    try:
        lines = ast.parse(code.strip()).body
    except SyntaxError:
        return [Partial(None, "", True)]
    if not lines or not all(isinstance(line, ast.Expr) for line in lines):
        return [Partial(None, "", True)]
    found = [c for line in lines if isinstance(line, ast.Expr)
             for c in (line.value.elts if isinstance(line.value, ast.List) else [line.value])]
    return [_call(node) for node in found]


def _call(node: ast.expr) -> Partial:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return Partial(None, "", True)
    try:
        arguments = {k.arg: _literal(k.value) for k in node.keywords if k.arg is not None}
    except (ValueError, TypeError):
        return Partial(None, "", True)
    return Partial(node.func.id, json.dumps(arguments, ensure_ascii=False), True)


def _literal(node: ast.expr) -> Any:
    """A keyword's value: a Python literal, with JSON's true, false and null read as Python's."""
    if isinstance(node, ast.Name) and node.id in NAMED:
        return NAMED[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys, values = node.keys, node.values
        return {_literal(k) if k is not None else None: _literal(v) for k, v in zip(keys, values, strict=True)}
    return ast.literal_eval(node)
