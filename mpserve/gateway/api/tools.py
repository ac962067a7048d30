"""Tool calls for chat completions: OpenAI's ``tools`` and ``tool_choice`` in, ``tool_calls`` out, in the format of
the model's template family (``mpserve.families``).

    tools, tool_choice ──parse_tools──▶ ToolSpec ──▶ the prompt: the model's template with ``tools``, or
                                           │         TOOLS_PROMPT in the system message (templates without)
                                           ├──▶ required / a named function: ``forced_grammar``, GBNF writing
                                           │    the family's own calls (one, or with parallel_tool_calls up to
                                           │    MAX_PARALLEL_CALLS), each one's arguments by its JSON Schema
    the chat template ──parser_for─────────┴──▶ its family's name (``Call.parser``)
    completion text ──parse_calls──────────────▶ (content, calls); calls [] means plain content
    forced completion ──forced_calls───────────▶ (calls, cut): never content
    streamed completion ──stream───────────────▶ a CallStream: content and the calls' deltas as they form

The family is the one the chat template's text names (``families.for_template``: the ChatML default's is
Hermes'). Under ``auto`` the text is read by the family's parser, then by the generic JSON one (an object, a
list of them, or ``{"tool_calls": [...]}``, fenced or not). A call that does not parse, names a function that was
not offered, or whose arguments are not a JSON object makes the whole reply plain content. A forced completion is
the family's calls, read as such: cut by max_tokens, the calls that completed before the cut are its calls and
the cut one is dropped. The forced grammar is compiled in the gateway, off its event loop, from the tools'
schemas (cached per schema, within ``mpserve.structured``'s limits of size and time), since only the gateway
knows the template's family.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from mpserve import families
from mpserve.errors import BadRequest
from mpserve.families.stream import CallStream
from mpserve.structured import canonical_json, schema_grammar

Parser = str
"""A template family's name (``mpserve.families.FAMILIES``): how a reply's calls are read and a forced one written."""
MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 4
"""Calls one forced reply may hold with parallel_tool_calls (the grammar needs a bound to end)."""

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
"""The tools prompt (Qwen 2.5's and Hermes') for templates that do not render ``tools`` themselves."""
TOOL_RESULT = "The tool {name} returned: {content}"
ANSWER_FROM_RESULTS = "Using this, answer: {question}"
"""How those templates are given tools' results: a user turn of a ``TOOL_RESULT`` line each, then the user's
question again (the rendering a model taught no tool format answers best: docs/reasoning.md)."""


def tool_results_turn(results: list[tuple[str, str]], question: str) -> str:
    """One user turn's text for the (function name, result) of consecutive tool messages, and the question."""
    lines = [TOOL_RESULT.format(name=name, content=content) for name, content in results]
    return "\n".join([*lines, ANSWER_FROM_RESULTS.format(question=question)])


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolSpec:
    tools: tuple[Tool, ...]
    choice: str  # "auto", "required", or the name of the function that must be called
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    @property
    def schemas(self) -> dict[str, dict[str, Any]]:
        """Each function's parameters by its name, as the families read calls against them."""
        return _schemas(self.tools)


def new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it

    @classmethod
    def new(cls, name: str, arguments: str) -> ToolCall:
        return cls(new_id(), name, arguments)

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# --- requests -----------------------------------------------------------------------------------

def parse_tools(tools: Any, choice: Any, parallel: Any) -> ToolSpec | None:
    """Check ``tools``, ``tool_choice`` and ``parallel_tool_calls``; None when no tool may be called."""
    if choice is None:
        choice = "auto" if tools else "none"
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise BadRequest("'parallel_tool_calls' must be a boolean")
    if tools is None or tools == []:
        if choice not in ("none", "auto"):
            raise BadRequest("'tool_choice' needs 'tools'")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadRequest(f"'tools' must be a list of at most {MAX_TOOLS} functions")
    parsed = tuple(_tool(t, i) for i, t in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise BadRequest("'tools' names a function twice")
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or function.get("name") not in names:
            raise BadRequest(f"'tool_choice' must be none, auto, required or {{\"type\": \"function\", \"function\": "
                             f"{{\"name\": NAME}}}} naming one of the tools ({', '.join(names)})")
        choice = function["name"]
    elif choice not in ("none", "auto", "required"):
        raise BadRequest("'tool_choice' must be none, auto, required or a named function")
    return None if choice == "none" else ToolSpec(parsed, choice, parallel)


def _tool(value: Any, i: int) -> Tool:
    function = value.get("function") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(function, dict):
        raise BadRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"parameters\"}}}}")
    name, description = function.get("name"), function.get("description", "")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(name, str) or not re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", name):
        raise BadRequest(f"tools[{i}].function.name must be 1 to 64 letters, digits, underscores or dashes")
    if not isinstance(description, str) or not isinstance(parameters, dict):
        raise BadRequest(f"tools[{i}].function: 'description' must be a string and 'parameters' a JSON Schema object")
    return Tool(name, description, parameters)


def forced_grammar(spec: ToolSpec, parser: Parser) -> str:
    """GBNF of a forced reply in family ``parser``'s format: one call of the named function, or of any (required),
    or with parallel_tool_calls under required, 1 to MAX_PARALLEL_CALLS calls, of any of the functions and in any
    order (the same call may come more than once). BadRequest when a tool's schema cannot be compiled."""
    named = [t for t in spec.tools if spec.choice in ("required", t.name)]
    for t in named:
        try:
            schema_grammar(canonical_json(t.parameters))
        except BadRequest as exc:
            raise BadRequest(f"tools[{spec.tools.index(t)}] ({t.name}): its parameters cannot be enforced for a forced "
                             f"call: {exc.message}") from None
    many = MAX_PARALLEL_CALLS if spec.choice == "required" and spec.parallel else 1
    return _forced_family(parser).grammar([(t.name, t.parameters) for t in named], many)


def _forced_family(parser: Parser) -> families.Family:
    """The family a forced reply is written and read in: the template's, or for a template without a call format
    of its own (the generic JSON family's), Hermes', which the tools prompt teaches."""
    family = families.FAMILIES[parser]
    return families.FAMILIES["hermes"] if family is families.GENERIC else family


def tools_prompt(spec: ToolSpec) -> str:
    return TOOLS_PROMPT.format(tools="\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in spec.tools))


def parser_for(template: str) -> Parser:
    """The family whose tool-call format a chat template teaches its model; Hermes for the ChatML default."""
    return families.for_template(template).name


def stream(parser: Parser, spec: ToolSpec | None) -> CallStream:
    """A streamed reply's reader: its content and calls as they form (no tools: the content only)."""
    if spec is not None and spec.forced:
        return CallStream(_forced_family(parser), spec.schemas)
    return CallStream(families.FAMILIES[parser], spec.schemas if spec else {}, families.GENERIC if spec else None)


# --- replies ------------------------------------------------------------------------------------

def parse_calls(text: str, parser: Parser, tools: tuple[Tool, ...]) -> tuple[str, list[ToolCall]]:
    """The content and the tool calls of a reply; (the content, []) when it holds no well-formed call."""
    family, schemas = families.FAMILIES[parser], _schemas(tools)
    found = families.read(family, text, schemas) or families.read(families.GENERIC, text, schemas)
    if found is None:
        return family.content(text), []
    return found[0], [ToolCall.new(f.name, f.arguments) for f in found[1]]


def forced_calls(text: str, parser: Parser, tools: tuple[Tool, ...]) -> tuple[list[ToolCall], bool]:
    """The calls of a forced reply (``forced_grammar``'s), and whether it ends in a call cut short (max_tokens),
    which is left out: only the calls that completed before it are read."""
    found, cut = families.read_forced(_forced_family(parser), text, _schemas(tools))
    return [ToolCall.new(f.name, f.arguments) for f in found], cut


def _schemas(tools: tuple[Tool, ...]) -> dict[str, dict[str, Any]]:
    return {t.name: t.parameters for t in tools}
