"""Tool calls for chat completions: OpenAI's ``tools`` and ``tool_choice`` in, ``tool_calls`` out.

    tools, tool_choice ──parse_tools──▶ ToolSpec ──▶ the prompt: the model's template with ``tools``, or
                                           │         TOOLS_PROMPT in the system message (templates without)
                                           ├──▶ required / a named function: ``forced_schema``, a JSON Schema
                                           │    the completion is constrained by ({"name", "arguments"}, or
                                           │    a list of them with parallel_tool_calls)
    completion text ──parse_calls──────────┴──▶ (content, calls); calls [] means plain content
    forced completion ──forced_calls───────────▶ (calls, cut): never content

A forced completion is JSON of the schema's shape, read as such (``forced_calls``): cut by max_tokens, the
calls that completed before the cut are its calls and the cut one is dropped. Under ``auto`` the
text is read after the fact by the parser of the model's family, chosen from its chat template
(``parser_for``), then by the generic one: Hermes / Qwen ``<tool_call>{...}</tool_call>``, Llama 3.x
``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``, several separated by ``;``),
Mistral ``[TOOL_CALLS][{...}]`` or ``[TOOL_CALLS]name[ARGS]{...}``, and generic JSON (an object, a list
of them, or ``{"tool_calls": [...]}``, fenced or not). A call that does not parse, names a function that
was not offered, or whose arguments are not a JSON object makes the whole reply plain content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from mpserve.errors import BadRequest

Parser = Literal["hermes", "llama3", "mistral", "json"]
PARSERS: tuple[Parser, ...] = ("hermes", "llama3", "mistral", "json")
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


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it

    @classmethod
    def new(cls, name: str, arguments: dict[str, Any]) -> ToolCall:
        return cls(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments, ensure_ascii=False))

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


def forced_schema(spec: ToolSpec) -> dict[str, Any]:
    """The JSON Schema a forced reply is constrained by: one call of the named function, or of any
    (required), or with parallel_tool_calls under required, a list of 1 to MAX_PARALLEL_CALLS calls, of any of
    the functions and in any order (the same call may come more than once)."""
    def call(tool: Tool) -> dict[str, Any]:
        return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
                "required": ["name", "arguments"], "additionalProperties": False}

    if spec.choice != "required":
        return call(next(t for t in spec.tools if t.name == spec.choice))
    one = call(spec.tools[0]) if len(spec.tools) == 1 else {"anyOf": [call(t) for t in spec.tools]}
    return {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS} if spec.parallel else one


def tools_prompt(spec: ToolSpec) -> str:
    return TOOLS_PROMPT.format(tools="\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in spec.tools))


def parser_for(template: str) -> Parser:
    """The tool-call format a chat template teaches its model; Hermes for the ChatML default."""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    if "<tool_call>" in template or not template:
        return "hermes"
    return "json"


# --- replies ------------------------------------------------------------------------------------

def parse_calls(text: str, parser: Parser, tools: tuple[Tool, ...]) -> tuple[str, list[ToolCall]]:
    """The content and the tool calls of a reply; ([], the whole text) when it holds no well-formed call."""
    names = {t.name for t in tools}
    for attempt in dict.fromkeys((parser, "json")):
        found = _PARSE[attempt](text)
        if found is not None:
            content, raw = found
            calls = [_call(c, names) for c in raw]
            if raw and all(c is not None for c in calls):
                return content, [c for c in calls if c is not None]
    return text, []


def forced_calls(text: str, tools: tuple[Tool, ...]) -> tuple[list[ToolCall], bool]:
    """The calls of a forced reply (``forced_schema``'s JSON: a call, or a list of them), and whether it ends in a
    call cut short (max_tokens), which is left out: only the calls that completed before it are read."""
    body, names = text.strip(), {t.name for t in tools}
    whole = _json(body)
    if whole is not None:
        raw = whole if isinstance(whole, list) else [whole]
        return [c for c in (_call(r, names) for r in raw) if c is not None], False
    complete, decoder, i = [], json.JSONDecoder(), 1
    while body.startswith("[") and i < len(body):  # a list: its calls up to the cut one
        while i < len(body) and body[i] in " \t\r\n,":
            i += 1
        try:
            value, i = decoder.raw_decode(body, i)
        except ValueError:
            break
        complete.append(value)
    return [c for c in (_call(r, names) for r in complete) if c is not None], True


def _call(raw: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(raw, dict) or raw.get("name") not in names:
        return None
    arguments = raw.get("arguments", raw.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall.new(raw["name"], arguments) if isinstance(arguments, dict) else None


_Found = tuple[str, list[Any]] | None


def _hermes(text: str) -> _Found:
    pieces = re.split(r"<tool_call>(.*?)(?:</tool_call>|$)", text, flags=re.DOTALL)
    if len(pieces) == 1:
        return None
    calls = [_json(body) for body in pieces[1::2]]
    return "".join(pieces[::2]).strip(), calls


def _llama3(text: str) -> _Found:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    calls, decoder, i = [], json.JSONDecoder(), 0
    while i < len(body):
        try:
            value, i = decoder.raw_decode(body, i)
        except ValueError:
            return None
        calls.append(value)
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
    return ("", calls) if calls and all(isinstance(c, dict) and "parameters" in c for c in calls) else None


def _mistral(text: str) -> _Found:
    content, marker, rest = text.partition("[TOOL_CALLS]")
    if not marker:
        return None
    rest = rest.strip()
    if rest.startswith("["):
        value = _json(rest)
        return content.strip(), value if isinstance(value, list) else [None]
    calls: list[Any] = []
    for chunk in rest.split("[TOOL_CALLS]"):
        name, args_marker, arguments = chunk.partition("[ARGS]")
        calls.append({"name": name.strip(), "arguments": _json(arguments)} if args_marker else None)
    return content.strip(), calls


def _generic(text: str) -> _Found:
    body = text.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, flags=re.DOTALL)
    value = _json(fenced.group(1) if fenced else body)
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        value = [c.get("function", c) if isinstance(c, dict) else c for c in value["tool_calls"]]
    if isinstance(value, dict) and "name" in value:
        return "", [value]
    if isinstance(value, list) and value:
        return "", value
    return None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


_PARSE = {"hermes": _hermes, "llama3": _llama3, "mistral": _mistral, "json": _generic}
