"""The request fields the OpenAPI document (``schema``) lists beyond each route's own: the sampling parameters as
``wire.GenerateParams`` declares them, structured output, tools, LoRA adapters, the pipeline's ``cache_salt`` and
``priority``, llama-server's extensions, and the fields an API has that mpserve takes only at their neutral value.

    GenerateParams' declaration ──param()──▶ a field's schema, with its limits and meaning
    extensions.FIELDS ──llama_server()──▶ n_predict and n_probs, and each ignored one described as ignored
    a dialect's UNSUPPORTED table ──unsupported()──▶ each field with the values it is taken at
    dialect.PIPELINE_FIELDS, a request's lora ──pipeline()──▶ cache_salt, priority, lora

Each route's parser declares the fields it takes (``openai.FIELDS``, ``responses.FIELDS``, ``messages.FIELDS``, ...);
``tests/unit/test_openapi_fields.py`` checks that the document lists those, no more and no fewer.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from mpserve.wire import protocol as wire

from . import extensions, reasoning
from . import openai as oai
from . import tools as tc

_PARAMS: dict[str, Any] = msgspec.json.schema(wire.GenerateParams)["$defs"]["GenerateParams"]["properties"]
TOOL_NAME = "^[a-zA-Z0-9_-]{1,64}$"


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "nullable": True}


def param(name: str) -> dict[str, Any]:
    """``GenerateParams``' field ``name`` as OpenAPI 3.0 takes it (null: not given), without the ZeroMQ default."""
    schema = dict(_PARAMS[name])
    schema.pop("default", None)
    for branch in schema.pop("anyOf", ()):
        if branch.get("type") != "null":
            schema |= branch
    return nullable(schema)


def sampling() -> dict[str, Any]:
    """llama.cpp's sampling fields that completions and chat take beyond OpenAI's, as the wire declares them."""
    names = ("presence_penalty", "frequency_penalty", "min_p", "typical_p", "ignore_eos", "speculative_n_max")
    bias = {"type": "number", "minimum": -100, "maximum": 100}
    pairs = {"type": "array", "maxItems": wire.MAX_LOGIT_BIAS, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "number"}}}
    return {name: param(name) for name in names} | {"logit_bias": nullable({
        "description": "OpenAI's {token id: bias} map, or llama-server's [[token id, bias]] pairs",
        "oneOf": [{"type": "object", "additionalProperties": bias, "maxProperties": wire.MAX_LOGIT_BIAS}, pairs]})}


def structured() -> dict[str, Any]:
    """``response_format`` and llama-server's ``grammar`` and ``json_schema``."""
    return {
        "response_format": nullable({"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string"}, "schema": {"type": "object"}, "strict": nullable({"type": "boolean"})}}}}),
        "grammar": param("grammar"),
        "json_schema": nullable({"description": "llama-server's: a JSON Schema the output follows (an object, or "
                                                "its JSON text); not with response_format or grammar",
                                 "oneOf": [{"type": "object"}, {"type": "string"}]}),
    }


def chat_tools() -> dict[str, Any]:
    """Chat's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (``tools``)."""
    function = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": TOOL_NAME}, "description": {"type": "string"},
        "parameters": {"type": "object"}, "strict": nullable({"type": "boolean"})}}
    tool = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"type": "string", "enum": ["function"]}, "function": function}}
    named = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"type": "string", "enum": ["function"]}, "function": {
            "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}
    return {
        "tools": nullable({"type": "array", "items": tool, "maxItems": tc.MAX_TOOLS}),
        "tool_choice": nullable({"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, named]}),
        "parallel_tool_calls": nullable({"type": "boolean"}),
    }


def pipeline() -> dict[str, Any]:
    """What every generation route takes: vLLM's ``cache_salt`` and ``priority``, llama-server's ``lora``."""
    adapter = {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "description": "the adapter's id (docs/adapters.md)"},
        "name": {"type": "string", "pattern": wire.ADAPTER_NAME_PATTERN},
        "scale": {"type": "number", "minimum": -wire.MAX_ADAPTER_SCALE, "maximum": wire.MAX_ADAPTER_SCALE}}}
    return {
        "cache_salt": nullable({"type": "string", "minLength": 1, "maxLength": wire.MAX_CACHE_SALT_CHARS,
                                "description": "requests that name the same salt may reuse each other's cached "
                                               "prompts"}),
        "priority": nullable({"type": "integer", "minimum": -100, "maximum": 100,
                              "description": "higher is more urgent, capped by the tenant's max_priority"}),
        "lora": nullable({"type": "array", "maxItems": wire.MAX_ADAPTERS, "items": adapter,
                          "description": "the LoRA adapters to apply, each by id or name"}),
    }


def chat_reasoning() -> dict[str, Any]:
    """Chat's thinking controls (``reasoning``), llama-server's two among them."""
    return {
        "reasoning_effort": nullable({"type": "string", "enum": list(reasoning.EFFORTS),
                                      "description": "the model's thinking budget for this effort; none: no thinking"}),
        "reasoning_budget": budget("most tokens the thinking takes before its end tag is forced"),
        "chat_template_kwargs": nullable({"type": "object", "description": "more variables for the chat template, "
                                          "as {\"enable_thinking\": false}"}),
        "reasoning_format": nullable({"type": "string", "enum": list(reasoning.FORMATS),
                                      "description": "none: the thinking stays in the content"}),
    }


def budget(description: str) -> dict[str, Any]:
    """A thinking budget in tokens."""
    return nullable({"type": "integer", "minimum": 0, "maximum": wire.MAX_TOKENS_LIMIT, "description": description})


def llama_server() -> dict[str, Any]:
    """llama-server's fields on completions and chat: those mapped, and those accepted and ignored."""
    ignored = {"description": "llama-server's; accepted and not applied (the X-Mpserve-Ignored header names it)"}
    return {name: ignored for name in sorted(extensions.IGNORED)} | {
        "n_predict": nullable({"type": "integer", "minimum": -1, "maximum": wire.MAX_TOKENS_LIMIT,
                               "description": "llama-server's max_tokens (-1: the default)"}),
        "n_probs": nullable({"type": "integer", "minimum": 0, "maximum": wire.MAX_TOP_LOGPROBS,
                             "description": "llama-server's logprobs"})}


def unsupported(table: oai.Unsupported) -> dict[str, Any]:
    """Each field an API has that mpserve does not implement: taken at its neutral values (or null), refused with
    a 400 otherwise."""
    return {name: {"nullable": True, "description": f"taken only as "
                   f"{' or '.join(json.dumps(v) for v in (*neutral, None))}: {why}"}
            for name, (neutral, why) in table.items()}


def ignored(names: tuple[str, ...], api: str) -> dict[str, Any]:
    """Fields of ``api`` that are taken and have no effect here."""
    return {name: {"description": f"{api}'s; accepted and not applied"} for name in names}
