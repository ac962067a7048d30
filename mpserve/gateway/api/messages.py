"""Anthropic's Messages API (``POST /v1/messages``) as a translation of chat completions (``dialect``). No I/O.

    {"system", "messages": [{"role", "content": text | [text | tool_use | tool_result blocks]}], "tools",
     "tool_choice", "max_tokens", "stop_sequences", ...}
        ──▶ a chat body: the system text as the system message; an assistant's tool_use blocks as its tool
            calls; a user's tool_result blocks as tool answers (before the rest of its turn) ──▶ openai.parse
    the chat completion ──▶ {"type": "message", "content": [thinking | text | tool_use blocks], "stop_reason",
                             "usage": {"input_tokens", "output_tokens"}}
    its chunks ──▶ message_start, ping, content_block_start, content_block_delta (thinking_delta and a last
        signature_delta, text_delta, input_json_delta), content_block_stop, ..., message_delta (stop_reason, usage),
        message_stop

Tools are custom tools (``{"name", "description", "input_schema"}``); ``tool_choice`` auto, any (chat's
required), tool (a named function) or none, with ``disable_parallel_tool_use``; ``output_config.format``
(a JSON schema) is chat's ``response_format``. ``temperature``, ``top_p`` and ``top_k``, which the SDK no
longer sends, are still taken (as ``extra_body``); ``cache_control``, ``metadata``, ``service_tier``, ``speed``
and the other routing fields are accepted and ignored. ``stop_reason``: end_turn,
max_tokens or tool_use; a stop sequence ends the turn as end_turn (the engine does not say which stop string
it met, so ``stop_sequence`` stays null). Errors are Anthropic's ``{"type": "error", "error": {"type",
"message"}}``. What Anthropic has and mpserve cannot do (documents, server tools, MCP) is
refused with 400 naming it; a field Anthropic does not have is refused as unrecognized.

Thinking (``reasoning``): where the model's template thinks, ``thinking`` ``{"type": "enabled", "budget_tokens"}``
sets its budget, ``adaptive`` leaves the model's, ``disabled`` turns it off; not given, the template's default
(thinking) holds. The thinking comes first, as a ``thinking`` block with a ``signature``; thinking blocks in the
history are dropped (templates leave earlier thinking out).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from mpserve.client import Result
from mpserve.errors import BadRequest

from ..http.errors import HttpError
from . import images, reasoning
from . import openai as oai
from .dialect import event, finish_reason

FIELDS = frozenset({"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k",
                    "stream", "tools", "tool_choice", "metadata", "service_tier", "thinking", "container",
                    "mcp_servers", "context_management", "output_config", "cache_control", "diagnostics",
                    "inference_geo", "speed", "user_profile_id", "workspace_id", "lora"})
UNSUPPORTED: oai.Unsupported = {
    "container": ((), "code execution containers are Anthropic's"),
    "mcp_servers": (([],), "MCP servers are not supported; give the tools"),
    "context_management": ((), "context management is not supported"),
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}


class Messages:
    """The dialect (``dialect.Dialect``) of ``/v1/messages``."""

    path = "/v1/messages"

    @staticmethod
    def parse(body: Any, owner: str) -> MessageAnswer:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        given = oai.given_fields(body, FIELDS, UNSUPPORTED)
        if "max_tokens" not in given:
            raise BadRequest("'max_tokens' is required")
        stop = given.get("stop_sequences")
        if stop is not None and not isinstance(stop, list):
            raise BadRequest("'stop_sequences' must be a list of strings")
        system = given.get("system")
        messages = ([{"role": "system", "content": _text(system, "system")}] if system else []) + \
            _messages(given.get("messages"))
        choice, parallel = _tool_choice(given.get("tool_choice"))
        chat = {"model": given.get("model"), "stream": given.get("stream"), "messages": messages,
                "max_tokens": given["max_tokens"], "temperature": given.get("temperature"),
                "top_p": given.get("top_p"), "top_k": given.get("top_k"), "stop": stop,
                "tools": _tools(given.get("tools")), "tool_choice": choice, "parallel_tool_calls": parallel,
                "response_format": _format(given.get("output_config")), "lora": given.get("lora"),
                **_thinking(given.get("thinking"))}
        call = oai.parse("chat", {k: v for k, v in chat.items() if v is not None})
        if given.get("thinking", {}).get("type") in ("enabled", "adaptive"):  # named where a template does not think
            call = dataclasses.replace(call, thinking=dataclasses.replace(call.thinking, named="thinking"))
        return MessageAnswer(call)

    @staticmethod
    def error_body(error: HttpError) -> dict[str, Any]:
        return error_body(error)


def error_body(error: HttpError) -> dict[str, Any]:
    """Anthropic's error shape; the type by status (``api_error`` for the other 5xx)."""
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


# --- requests -----------------------------------------------------------------------------------

def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise BadRequest("'messages' is required and must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise BadRequest(f"{where} must be an object whose 'role' is user or assistant")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise BadRequest(f"{where}.content must be a string or a list of content blocks")
        text: list[str | dict[str, Any]] = []
        calls, answers = [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "image" and message["role"] == "user":
                text.append(images.from_image_block(block, at))
            elif kind == "tool_use" and message["role"] == "assistant":
                calls.append(_tool_use(block, at))
            elif kind == "tool_result" and message["role"] == "user":
                answers.append(_tool_result(block, at))
            elif kind in ("thinking", "redacted_thinking") and message["role"] == "assistant":
                continue  # an earlier reply's thinking: templates leave it out of the conversation
            else:
                raise BadRequest(f"{at}: a {message['role']} message's blocks are text and "
                                 f"{'tool_use' if message['role'] == 'assistant' else 'image and tool_result'}; "
                                 f"{kind!r:.30} is not supported by mpserve (documents, thinking)")
        out += answers
        if calls:
            out.append({"role": "assistant", "content": images.joined(text) or None, "tool_calls": calls})
        elif text or not answers:
            out.append({"role": message["role"], "content": images.joined(text)})
    return out


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or \
            not isinstance(block.get("input"), dict):
        raise BadRequest(f"{where}: a tool_use block needs 'id', 'name' and 'input' (an object)")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise BadRequest(f"{where}: a tool_result block needs 'tool_use_id'")
    content = _text(block.get("content", ""), f"{where}.content")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _text(value: Any, where: str) -> str:
    """A string, or text blocks (their cache_control and citations are ignored)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text" and
                                       isinstance(b.get("text"), str) for b in value):
        return "".join(b["text"] for b in value)
    raise BadRequest(f"'{where}' must be a string or a list of text blocks")


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise BadRequest("'tools' must be a list of tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise BadRequest(f"tools[{i}].type {kind!r:.40} is not supported by mpserve: only custom tools "
                             "({\"name\", \"description\", \"input_schema\"}) are; server tools are Anthropic's")
        function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _thinking(value: Any) -> dict[str, Any]:
    """``thinking`` as chat's fields: enabled with its ``budget_tokens`` (adaptive: the model's budget), or
    disabled; not given, the model's template decides (one that thinks does)."""
    if value is None:
        return {}
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if kind == "adaptive":
        return {"chat_template_kwargs": {"enable_thinking": True}}
    if kind != "enabled" or "budget_tokens" not in value:
        raise BadRequest("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": \"adaptive\"} "
                         "or {\"type\": \"disabled\"}")
    return {"chat_template_kwargs": {"enable_thinking": True},
            "reasoning_budget": reasoning.budget_tokens(value["budget_tokens"], "thinking.budget_tokens")}


def _format(config: Any) -> dict[str, Any] | None:
    """``output_config.format`` (structured output) as chat's ``response_format``; an ``effort`` is refused."""
    if config is None:
        return None
    if not isinstance(config, dict) or not set(config) <= {"format", "effort"}:
        raise BadRequest("'output_config' must be {\"format\": {\"type\": \"json_schema\", \"schema\": {...}}}")
    if config.get("effort") is not None:
        raise BadRequest("'output_config.effort' is not supported by mpserve: effort levels are Claude's")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise BadRequest("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _tool_choice(value: Any) -> tuple[Any, bool | None]:
    """Chat's tool_choice and parallel_tool_calls."""
    if value is None:
        return None, None
    kind = value.get("type") if isinstance(value, dict) else None
    choice: Any = {"auto": "auto", "any": "required", "none": "none"}.get(kind) if isinstance(kind, str) else None
    if kind == "tool":
        choice = {"type": "function", "function": {"name": value.get("name")}}
    if choice is None or not isinstance(value.get("disable_parallel_tool_use", False), bool):
        raise BadRequest("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", "
                         "\"name\": NAME}, with an optional boolean disable_parallel_tool_use")
    return choice, not value.get("disable_parallel_tool_use", False)


# --- answers ------------------------------------------------------------------------------------

@dataclass
class MessageAnswer:
    """One message: whole (``whole``) or streamed (``opened``, ``chunk``, ``closed``)."""

    call: oai.Call
    id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    _block: dict[str, Any] | None = None  # the content block being streamed
    _blocks: int = 0  # content blocks started

    def whole(self, completion: dict[str, Any]) -> dict[str, Any]:
        choice = completion["choices"][0]
        message = choice["message"]
        content = [_thought(message["reasoning_content"])] if "reasoning_content" in message else []
        content += [{"type": "text", "text": message["content"]}] if message.get("content") or \
            not message.get("tool_calls") else []
        content += [{"type": "tool_use", "id": _tool_id(c["id"]), "name": c["function"]["name"],
                     "input": json.loads(c["function"]["arguments"])} for c in message.get("tool_calls") or ()]
        u = completion["usage"]
        return {**self._message(completion["model"], content, STOP_REASONS.get(choice["finish_reason"], "end_turn")),
                "usage": _usage(u["prompt_tokens"], u["completion_tokens"],
                                u["prompt_tokens_details"]["cached_tokens"])}

    def opened(self, model: str) -> list[bytes]:
        return [_event("message_start", message={**self._message(model, [], None), "usage": _usage(0, 0, 0)}),
                _event("ping")]

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        for choice in chunk["choices"]:
            delta = choice.get("delta", {})
            if delta.get("reasoning_content"):
                if self._block is None or self._block["type"] != "thinking":
                    out += self._start({"type": "thinking", "thinking": ""})
                self._block["thinking"] += delta["reasoning_content"]  # type: ignore[index]  # just started
                out.append(_event("content_block_delta", index=self._blocks - 1,
                                  delta={"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                if self._block is None or self._block["type"] != "text":
                    out += self._start({"type": "text", "text": ""})
                out.append(_event("content_block_delta", index=self._blocks - 1,
                                  delta={"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                function = call.get("function", {})
                if call.get("id"):
                    out += self._start({"type": "tool_use", "id": _tool_id(call["id"]),
                                        "name": function.get("name", ""), "input": {}})
                if function.get("arguments"):
                    out.append(_event("content_block_delta", index=self._blocks - 1,
                                      delta={"type": "input_json_delta", "partial_json": function["arguments"]}))
        return out

    def closed(self, last: list[dict[str, Any]], results: list[Result]) -> list[bytes]:
        out = [e for chunk in last for e in self.chunk(chunk)]
        finish = finish_reason(last)
        if self._blocks == 0:
            out += self._start({"type": "text", "text": ""})
        out += self._stop()
        usage = oai.total_usage(results)
        return [*out, _event("message_delta", delta={"stop_reason": STOP_REASONS.get(finish, "end_turn"),
                                                     "stop_sequence": None},
                             usage=_usage(usage.prompt_tokens, usage.completion_tokens,
                                          results[0].timings.cached_tokens)),
                _event("message_stop")]

    @staticmethod
    def failed(error: HttpError) -> bytes:
        return event("error", error_body(error))

    def _message(self, model: str, content: list[dict[str, Any]], stop_reason: str | None) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": None}

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        out = self._stop()
        self._block = block
        self._blocks += 1
        return [*out, _event("content_block_start", index=self._blocks - 1, content_block=dict(block))]

    def _stop(self) -> list[bytes]:
        """The events that end the block being streamed: a thinking block's signature, then its stop."""
        block, self._block = self._block, None
        if block is None:
            return []
        signed = [_event("content_block_delta", index=self._blocks - 1, delta={
            "type": "signature_delta", "signature": _thought(block["thinking"])["signature"]})] \
            if block["type"] == "thinking" else []
        return [*signed, _event("content_block_stop", index=self._blocks - 1)]


def _event(kind: str, **fields: Any) -> bytes:
    return event(kind, {"type": kind, **fields})


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, int]:
    """Anthropic's usage: ``cached`` prompt tokens were read from a cache (``timings.cached_tokens``); as Anthropic
    counts them, ``input_tokens`` are the others (the prompt is their sum)."""
    return {"input_tokens": prompt_tokens - cached, "output_tokens": completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _thought(text: str) -> dict[str, Any]:
    """A thinking block. Its ``signature`` is a digest of its text: clients keep it and send it back with the block,
    which mpserve drops from the conversation (its templates leave earlier thinking out), so nothing checks it."""
    return {"type": "thinking", "thinking": text, "signature": base64.b64encode(
        hashlib.sha256(text.encode()).digest()).decode()}


def _tool_id(call_id: str) -> str:
    """Anthropic's tool_use id for a chat tool call's id."""
    return "toolu_" + call_id.removeprefix("call_")
