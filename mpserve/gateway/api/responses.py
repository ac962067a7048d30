"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``) as a translation of
chat completions (``dialect``), and its stored responses (``stored_routes``).

    {"input": text | [items], "instructions", "tools", "text": {"format"}, "previous_response_id", ...}
        ──▶ a chat body: instructions as the system message, then the stored conversation of the previous
            response, then the items: messages (input_text / output_text parts), function_call items as an
            assistant's tool calls, function_call_output items as tool answers ──▶ openai.parse("chat")
    the chat completion ──▶ {"object": "response", "status", "output": [reasoning | message | function_call
                             items], "usage": {"input_tokens", "output_tokens", ...}}
    its chunks ──▶ response.created, response.in_progress, response.output_item.added,
        response.content_part.added, response.reasoning_text.delta ... done, response.output_text.delta ... done,
        response.function_call_arguments.delta ... done, response.output_item.done, then response.completed
        (response.incomplete when max_output_tokens cut it), each with its sequence_number

Tools are function tools (``{"type": "function", "name", "parameters"}``), with ``tool_choice`` none, auto,
required or ``{"type": "function", "name"}``; ``text.format`` is text, json_object or json_schema (``{"type":
"json_schema", "name", "schema"}``), as chat's ``response_format``. ``store`` (default true, as OpenAI's) keeps
the response and its conversation in ``response_store.ResponseStore``: per API key, within a byte budget per
key and one in all, in a file every gateway process of the port shares; ``previous_response_id`` continues one
(its instructions are not carried over, as OpenAI documents). ``background: true`` runs a response to its end
whoever reads it (``dialect.Pipeline``), its request journaled so that another gateway process takes it over when
it is read after its own died (``Pipeline.revive``). A field OpenAI has and mpserve cannot honour (built-in tools,
files, ...) is refused with 400 naming it, unless sent at its neutral value; a field OpenAI
does not have is refused as unrecognized.

Reasoning (``reasoning``): where the model's template thinks, ``reasoning: {"effort"}`` (none turns it off) and
mpserve's ``reasoning_budget`` (tokens) are chat's fields; the thinking is a ``reasoning`` item before the message,
its whole text as its content (no summary is made), its tokens ``usage.output_tokens_details.reasoning_tokens``.
Reasoning items in ``input`` are dropped (templates leave earlier thinking out).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mpserve.client import Result
from mpserve.errors import BadRequest
from mpserve.wire import protocol as wire

from ..http.encode import EventStream
from ..http.errors import HttpError
from . import images, reasoning
from . import openai as oai
from .dialect import Background, Pipeline, event, finish_reason, owner
from .journal import Journal, NoStream
from .response_store import NotStored, ResponseStore

FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
    "parallel_tool_calls", "text", "stream", "stream_options", "store", "previous_response_id", "metadata", "user",
    "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier", "truncation", "reasoning",
    "include", "background", "top_logprobs", "max_tool_calls", "prompt", "conversation", "context_management",
    "lora", "reasoning_budget"})
UNSUPPORTED: oai.Unsupported = {
    "truncation": (("disabled",), "mpserve does not drop input items to fit the context"),
    "include": (([],), "no extra output (reasoning, logprobs, tool results) is available"),
    "top_logprobs": ((0,), "log-probabilities are not returned here (use /v1/chat/completions)"),
    "prompt": ((), "stored prompt templates are OpenAI's"),
    "conversation": ((), "conversations are not stored; use previous_response_id"),
    "context_management": ((), "context management is not supported"),
    "service_tier": (("auto", "default"), "mpserve has one service tier"),
}
ROLES = ("user", "assistant", "system", "developer")


class Responses:
    """The dialect (``dialect.Dialect``) of ``/v1/responses``."""

    path = "/v1/responses"

    def __init__(self, store: ResponseStore, journal: Journal) -> None:
        self.store = store
        self.journal = journal

    def parse(self, body: Any, owner: str) -> ResponseAnswer:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        given = oai.given_fields(body, FIELDS, UNSUPPORTED)
        for key in ("store", "stream", "parallel_tool_calls", "background"):
            if not isinstance(given.get(key, False), bool):
                raise BadRequest(f"'{key}' must be a boolean")
        metadata = given.get("metadata", {})
        if not isinstance(metadata, dict) or len(metadata) > 16 or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise BadRequest("'metadata' must be an object of at most 16 string values")
        history: list[dict[str, Any]] = []
        previous = given.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str):
                raise BadRequest("'previous_response_id' must be a string")
            history = list(self.store.get(owner, previous)[1])
        instructions = given.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise BadRequest("'instructions' must be a string")
        conversation = history + _items(given.get("input"))
        chat: dict[str, Any] = {
            "model": given.get("model"), "stream": given.get("stream"),
            "messages": ([{"role": "system", "content": instructions}] if instructions else []) + conversation,
            "temperature": given.get("temperature"), "top_p": given.get("top_p"),
            "max_tokens": given.get("max_output_tokens"), "user": given.get("user"),
            "tools": _tools(given.get("tools")), "tool_choice": _tool_choice(given.get("tool_choice")),
            "parallel_tool_calls": given.get("parallel_tool_calls"), "response_format": _format(given.get("text")),
            "lora": given.get("lora"), "reasoning_effort": _effort(given.get("reasoning")),
            "reasoning_budget": given.get("reasoning_budget")}
        call = oai.parse("chat", {k: v for k, v in chat.items() if v is not None})
        if call.thinking.named == "reasoning_effort":  # named as this API names it
            call = dataclasses.replace(call, thinking=dataclasses.replace(call.thinking, named="reasoning.effort"))
        echo = {"instructions": instructions, "max_output_tokens": given.get("max_output_tokens"),
                "metadata": metadata, "parallel_tool_calls": given.get("parallel_tool_calls", True),
                "previous_response_id": previous, "store": given.get("store", True),
                "temperature": call.params.temperature, "top_p": call.params.top_p,
                "text": {"format": given.get("text", {}).get("format", {"type": "text"})},
                "tool_choice": given.get("tool_choice", "auto"), "tools": given.get("tools", []),
                "truncation": "disabled", "user": given.get("user"), "background": given.get("background", False),
                "reasoning": {"effort": chat["reasoning_effort"], "summary": None}}
        answer = ResponseAnswer(call, echo, conversation, self.store, owner)
        if given.get("background"):
            if not echo["store"]:
                raise BadRequest("'background' needs 'store': a background response is read when it is done "
                                 "(GET /v1/responses/{id}), so it must be stored")
            answer.background = Background(answer.id, json.dumps(answer.head("queued")).encode())
        return answer

    def resumed(self, body: Any, owner: str, head: bytes) -> ResponseAnswer:
        """The background response whose object was ``head``, parsed again from its request ``body`` (``revive``)."""
        answer = self.parse(body, owner)
        known = json.loads(head)
        answer.id, answer.created_at = known["id"], known["created_at"]
        answer.background = Background(answer.id, head)
        return answer

    @staticmethod
    def error_body(error: HttpError) -> dict[str, Any]:
        return error.body()


# --- requests -----------------------------------------------------------------------------------

def _items(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: a text is one user message; consecutive function_call items are one
    assistant message's tool calls."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRequest("'input' is required: a string, or a non-empty list of input items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} must be an object (a message, a function_call or a function_call_output)")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}")
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = _function_call(item, where)
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":  # an earlier reply's thinking: templates leave it out of the conversation
            continue
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise BadRequest(f"{where}.call_id must be a string")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text(output, f"{where}.output")})
        else:
            raise BadRequest(f"{where}.type {kind!r:.40} is not supported by mpserve: input items are messages, "
                             "function_call and function_call_output")
    return out


def _text(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content: a string, or text parts (input_text, output_text), images (input_image, as chat's
    image_url parts) and audio clips (input_audio, as chat's own)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str | dict[str, Any]] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "input_image":
                parts.append(images.from_input_image(part, f"{where}.content[{j}]"))
                continue
            if kind == "input_audio":
                parts.append({"type": "input_audio", "input_audio": part.get("input_audio")})
                continue
            if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}.content[{j}] must be an input_text, input_image, input_audio or "
                                 f"output_text part; other parts ({kind!r:.30}: files) are not supported")
            parts.append(part["text"])
        return images.joined(parts)
    raise BadRequest(f"{where}.content must be a string or a list of text parts")


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, str):
        raise BadRequest(f"{where}: a function_call needs 'call_id', 'name' and 'arguments' (JSON text) strings")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _effort(value: Any) -> str | None:
    """``reasoning``: its ``effort`` as chat's ``reasoning_effort``; a ``summary`` is taken and not made (the
    thinking comes whole, as the reasoning item's content)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not set(value) <= {"effort", "summary", "generate_summary"}:
        raise BadRequest("'reasoning' must be an object like {\"effort\": \"low\"}")
    effort = value.get("effort")
    if effort is not None and effort not in reasoning.EFFORTS:
        raise BadRequest(f"'reasoning.effort' must be one of {', '.join(reasoning.EFFORTS)}, got {str(effort)!r:.40}")
    return effort


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise BadRequest("'tools' must be a list of function tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise BadRequest(f"tools[{i}].type {kind!r:.40} is not supported by mpserve: only function tools are "
                             "(built-in tools such as web_search, file_search or code_interpreter are OpenAI's)")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    if value is not None and value not in ("none", "auto", "required"):
        raise BadRequest("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"name\": NAME}")
    return value


def _format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    if text is None:
        return None
    fmt = text.get("format", {"type": "text"}) if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or not set(text) <= {"format", "verbosity"}:
        raise BadRequest("'text' must be {\"format\": {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}}")
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("name"), str):
            raise BadRequest("'text.format' json_schema needs a 'name' and a 'schema'")
        return {"type": "json_schema", "json_schema": {"name": fmt["name"], "schema": fmt.get("schema"),
                                                        "strict": fmt.get("strict")}}
    if fmt.get("type") not in ("text", "json_object"):
        raise BadRequest("'text.format.type' must be text, json_object or json_schema")
    return {"type": fmt["type"]}


# --- answers ------------------------------------------------------------------------------------

@dataclass
class ResponseAnswer:
    """One response: whole (``whole``) or streamed (``opened``, ``chunk``, ``closed``), stored when done."""

    call: oai.Call
    echo: dict[str, Any]  # the request's settings, as a response repeats them
    conversation: list[dict[str, Any]]  # the chat messages so far, without the instructions
    store: ResponseStore
    owner: str
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    _sequence: int = 0
    _model: str = ""
    _output: list[dict[str, Any]] = field(default_factory=list)  # streamed items, in their final state
    _open: dict[str, Any] | None = None  # the item being streamed
    background: Background | None = None  # ``background: true``: run to its end whoever reads it

    def head(self, status: str) -> dict[str, Any]:
        """The response before it has output (a background one, queued; or cancelled)."""
        return self._object(self.call.model or "", status, [], None)

    def whole(self, completion: dict[str, Any]) -> dict[str, Any]:
        choice = completion["choices"][0]
        message = choice["message"]
        output = [_reasoning(message["reasoning_content"])] if "reasoning_content" in message else []
        output += [_message(message["content"])] if message.get("content") or not message.get("tool_calls") else []
        output += [_function_item(c) for c in message.get("tool_calls") or ()]
        u = completion["usage"]
        return self._finished(completion["model"], output, choice["finish_reason"], wire.Usage(
            u["prompt_tokens"], u["completion_tokens"], u["completion_tokens_details"]["reasoning_tokens"]),
            u["prompt_tokens_details"]["cached_tokens"])

    def opened(self, model: str) -> list[bytes]:
        self._model = model
        started = self._object(model, "in_progress", [], None)
        return [self._event("response.created", response=started), self._event("response.in_progress",
                                                                                response=started)]

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        for choice in chunk["choices"]:
            delta = choice.get("delta", {})
            if delta.get("reasoning_content"):
                out += self._part(_reasoning(""), delta["reasoning_content"])
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._call_delta(call)
        return out

    def closed(self, last: list[dict[str, Any]], results: list[Result]) -> list[bytes]:
        out = [e for chunk in last for e in self.chunk(chunk)]
        finish = finish_reason(last)
        if all(item["type"] == "reasoning" for item in [*self._output, *([self._open] if self._open else [])]):
            out += self._text("")
        out += self._close()
        response = self._finished(self._model, self._output, finish, oai.total_usage(results),
                                  results[0].timings.cached_tokens)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [*out, self._event(kind, response=response)]

    def failed(self, error: HttpError) -> bytes:
        self._sequence += 1
        return _error_event(error, self._sequence - 1)

    # --- building ---

    def _finished(self, model: str, output: list[dict[str, Any]], finish: str, u: wire.Usage,
                  cached: int) -> dict[str, Any]:
        """``cached``: the input tokens taken from a cache (``timings.cached_tokens``), counted in
        ``input_tokens`` too, as OpenAI counts them."""
        usage = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
                 "output_tokens": u.completion_tokens,
                 "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
                 "total_tokens": u.total_tokens}
        cut = finish == "length"
        response = self._object(model, "incomplete" if cut else "completed", output, usage)
        if cut:
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.echo["store"]:
            self.store.put(self.owner, response, self.conversation + _as_chat(output))
        return response

    def _object(self, model: str, status: str, output: list[dict[str, Any]],
                usage: dict[str, Any] | None) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": model, "output": output, "usage": usage, "error": None, "incomplete_details": None,
                **self.echo}

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event(kind, data)

    def _text(self, text: str) -> list[bytes]:
        return self._part(_message(""), text)

    def _part(self, item: dict[str, Any], text: str) -> list[bytes]:
        """``text`` streamed into the one part of a message or reasoning item (``item``, opened if it is not)."""
        out: list[bytes] = []
        kind = item["content"][0]["type"]  # output_text, reasoning_text
        extra: dict[str, Any] = {"logprobs": []} if kind == "output_text" else {}
        if self._open is None or self._open["type"] != item["type"]:
            out += self._close()
            self._open = {**item, "status": "in_progress"}
            index = len(self._output)
            out.append(self._event("response.output_item.added", output_index=index,
                                   item={**self._open, "content": []}))
            part = {k: v for k, v in item["content"][0].items() if k != "logprobs"}
            out.append(self._event("response.content_part.added", item_id=self._open["id"], output_index=index,
                                   content_index=0, part=part))
        part = self._open["content"][0]
        part["text"] += text
        if text:
            out.append(self._event(f"response.{kind}.delta", item_id=self._open["id"],
                                   output_index=len(self._output), content_index=0, delta=text, **extra))
        return out

    def _call_delta(self, delta: dict[str, Any]) -> list[bytes]:
        """A chat tool call delta: its id and name open a function_call item, its arguments stream into it."""
        out: list[bytes] = []
        function = delta.get("function", {})
        if delta.get("id"):
            out += self._close()
            self._open = {**_function_item({"id": delta["id"], "function": {
                "name": function.get("name", ""), "arguments": ""}}), "status": "in_progress"}
            out.append(self._event("response.output_item.added", output_index=len(self._output), item=self._open))
        if function.get("arguments") and self._open is not None:
            self._open["arguments"] += function["arguments"]
            out.append(self._event("response.function_call_arguments.delta", item_id=self._open["id"],
                                   output_index=len(self._output), delta=function["arguments"]))
        return out

    def _close(self) -> list[bytes]:
        """The done events of the item being streamed."""
        item, self._open = self._open, None
        if item is None:
            return []
        index, item["status"] = len(self._output), "completed"
        out = []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            extra: dict[str, Any] = {"logprobs": []} if part["type"] == "output_text" else {}
            out += [self._event(f"response.{part['type']}.done", item_id=item["id"], output_index=index,
                                content_index=0, text=part["text"], **extra),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=part)]
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
        self._output.append(item)
        return [*out, self._event("response.output_item.done", output_index=index, item=item)]


def _message(text: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning(text: str) -> dict[str, Any]:
    """A reasoning item: the reply's thinking, whole, as its content (no summary is made)."""
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "status": "completed", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _function_item(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


def _as_chat(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat messages that continue its conversation."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


def stored_routes(responses: Responses, pipeline: Pipeline) -> list[Route]:
    """``GET`` and ``DELETE /v1/responses/{id}``: a stored response of the caller's API key; a background one
    while it runs too (taken over here if its gateway process died: ``Pipeline.revive``), and its events again
    (``?stream=true&starting_after=N``); a DELETE drops all of that, stopping one that runs; ``POST …/cancel``
    stops one."""
    async def retrieve(request: Request) -> Response:
        who, response_id = owner(request), request.path_params["id"]
        try:
            with contextlib.suppress(NoStream):
                if responses.journal.stream(who, response_id).state == "orphaned":
                    await pipeline.revive(request, responses, response_id)
            if request.query_params.get("stream") == "true":
                return _stream_again(responses.journal, who, response_id, request.query_params.get("starting_after"))
            try:
                return JSONResponse(responses.store.get(who, response_id)[0])
            except NotStored as missing:
                try:
                    return JSONResponse(_running(responses.journal, who, response_id))
                except NotStored:
                    return _not_found(missing)  # the store's words: how long responses are kept
        except NotStored as exc:
            return _not_found(exc)
        except BadRequest as exc:
            return JSONResponse(HttpError.from_mpserve(exc).body(), 400)

    async def cancel(request: Request) -> Response:
        who, response_id = owner(request), request.path_params["id"]
        try:
            running = _running(responses.journal, who, response_id)  # a background response of the caller's
        except NotStored:
            running = {}
        if running.get("status") != "in_progress" or not responses.journal.cancel(who, response_id):
            return _not_found(NotStored(f"no background response {response_id!r:.80} is in progress: only one that "
                                        "runs can be cancelled"))
        return JSONResponse({**running, "status": "cancelled"})

    async def delete(request: Request) -> Response:
        who, response_id = owner(request), request.path_params["id"]
        try:
            responses.store.delete(who, response_id, journaled=responses.journal.delete(who, response_id))
        except NotStored as exc:
            return _not_found(exc)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    return [Route("/v1/responses/{id}", retrieve, methods=["GET"]),
            Route("/v1/responses/{id}", delete, methods=["DELETE"]),
            Route("/v1/responses/{id}/cancel", cancel, methods=["POST"])]


def _running(journal: Journal, who: str, response_id: str) -> dict[str, Any]:
    """A background response not stored (yet): in progress, or how it ended without output (cancelled; failed,
    its gateway process dead too)."""
    try:
        stream = journal.stream(who, response_id)
    except NoStream:
        raise NotStored(f"no stored response with id {response_id!r:.80}") from None
    head: dict[str, Any] = json.loads(stream.head or b"{}")
    if not head:
        raise NotStored(f"no stored response with id {response_id!r:.80}")
    state = {"running": "in_progress", "cancelling": "cancelled", "cancelled": "cancelled"}.get(stream.state,
                                                                                                  "failed")
    return {**head, "status": state}


def _stream_again(journal: Journal, who: str, response_id: str, after: str | None) -> Response:
    """A background response's events after ``starting_after`` (all of them without it), then on as they come."""
    if after is not None and not after.isdigit():
        raise BadRequest(f"starting_after must be an event's sequence_number, got {after!r:.40}")
    _running(journal, who, response_id)  # NotStored unless it is a background response of the caller's
    return EventStream(journal.tail(who, response_id, int(after) if after is not None else -1,
                                    lambda exc, seq: _error_event(HttpError.from_mpserve(exc), seq)))


def _error_event(error: HttpError, sequence: int) -> bytes:
    return event("error", {"type": "error", "sequence_number": sequence, "code": error.code,
                           "message": error.message, "param": None})


def _not_found(exc: NotStored) -> JSONResponse:
    return JSONResponse(HttpError(404, "not_found", exc.message).body(), 404)
