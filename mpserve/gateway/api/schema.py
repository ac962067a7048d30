"""The gateway's OpenAPI 3.0 document (``GET /openapi.json``), built from the same limits the code enforces,
so standard tools can check and fuzz the API. Error statuses are those ``errors.CODES``, ``http.limits`` and
``http.guard`` answer with; the 5xx ones a client may see are 502 (an instance died or stalled), 503 (no server,
shutting down, a model that failed or does not fit) and 504 (the request's timeout).
"""

from __future__ import annotations

from typing import Any

from mpserve.wire import protocol as wire

from ..http import limits
from . import embeddings as emb
from . import messages, reasoning, responses
from . import openai as oai
from . import schema_fields as fields
from . import tools as tc
from .schema_fields import TOOL_NAME, nullable

ERROR_STATUSES = {
    "400": "bad parameters, not JSON, over a size limit (each names its limit)",
    "401": "no valid API key",
    "403": "a Host that is not the gateway's, or a web page of an origin not in --allowed-origins",
    "404": "the model is not served",
    "408": "the request (its headers, or its body) did not arrive within the read timeout",
    "413": "the body is over MAX_BODY_BYTES",
    "415": "a POST body that is not application/json",
    "429": "the model's queue is full; Retry-After says when to retry",
    "502": "the instance died or stalled",
    "503": "no server answers, it is shutting down, or the model failed to load or does not fit",
    "504": "the request's timeout passed",
}


def document(version: str) -> dict[str, Any]:
    errors = {status: {"$ref": f"#/components/responses/E{status}"} for status in ERROR_STATUSES}
    anthropic_errors = {status: {"$ref": f"#/components/responses/A{status}"} for status in ERROR_STATUSES}
    return {"openapi": "3.0.3", "info": {"title": "mpserve OpenAI-compatible gateway", "version": version},
            "paths": {**_generation_paths(errors, anthropic_errors), **_other_paths(errors)},
            "components": _components()}


def _generation_paths(errors: dict[str, Any], anthropic_errors: dict[str, Any]) -> dict[str, Any]:
    """The routes that generate: completions, chat, Responses (and its stored responses), Messages."""
    return {
        "/v1/completions": {"post": _generation("completions", "CompletionRequest", errors)},
        "/v1/chat/completions": {"post": _generation("chat completions", "ChatRequest", errors)},
        "/v1/responses": {"post": _generation("Responses (Agents SDK, newer clients)", "ResponseRequest", errors)},
        "/v1/responses/{id}": {
            "get": {**_get("a stored response of the caller's API key, or a background one in progress; with "
                           "stream=true, a background response's events after starting_after (server-sent "
                           "events)", "application/json", {k: errors[k] for k in ("400", "401", "404")}),
                    "parameters": [_ID, {"name": "stream", "in": "query", "required": False,
                                         "schema": {"type": "string", "enum": ["true", "false"]}},
                                   {"name": "starting_after", "in": "query", "required": False,
                                    "schema": {"type": "integer", "minimum": 0}}]},
            "delete": {**_get("a stored response deleted; a background one whole (its events and request too), "
                              "stopped first if in progress", "application/json",
                              {k: errors[k] for k in ("401", "404")}), "parameters": [_ID]}},
        "/v1/responses/{id}/cancel": {
            "post": {**_get("a background response in progress stopped", "application/json",
                            {k: errors[k] for k in ("401", "404")}), "parameters": [_ID]}},
        "/v1/messages": {"post": {**_post("Anthropic Messages, whole (JSON) or streamed (server-sent events)",
                                          "MessageRequest", "the message", True, anthropic_errors),
                                  "security": [{"bearer": []}, {"apiKey": []}, {}]}},
    }


def _other_paths(errors: dict[str, Any]) -> dict[str, Any]:
    """The other routes: vectors, models, health and metrics, slots, tokens, the admin API, the console."""
    return {
        "/v1/embeddings": {"post": _post("OpenAI embeddings, from a model served with embedding: true",
                                         "EmbeddingRequest", "one vector per input", False, errors)},
        "/v1/rerank": {"post": _post("a reranker's scores (a model served with pooling: rank), llama-server's "
                                     "shape", "RerankRequest", "the documents by relevance", False, errors)},
        "/rerank": {"post": _post("llama-server's name for /v1/rerank", "RerankRequest",
                                  "the documents by relevance", False, errors)},
        "/v1/models": {"get": _get("the served models", "application/json", {"503": errors["503"],
                                                                               "401": errors["401"]})},
        "/health": {"get": _get("200 while some instance can take a request", "application/json",
                                {"503": {"description": "no instance is ready, or no server answers",
                                         "content": {"application/json": {"schema": {"type": "object"}}}}})},
        "/metrics": {"get": _get("Prometheus text", "text/plain", {"401": errors["401"]})},
        "/backend/monitor": {"get": {
            **_get("each instance (worker process) of a server on this host, with its slots", "application/json",
                   {k: errors[k] for k in ("401", "404", "503")}),
            "parameters": [{"name": "model", "in": "query", "required": False, "schema": {"type": "string"}}]}},
        "/slots/{slot}": {"post": {
            **_get("an idle slot's KV cells saved to a file of its model's slot_save_path, restored from one, "
                   "or erased", "application/json",
                   {k: errors[k] for k in ("400", "401", "403", "404", "415", "429", "502", "503")}),
            "security": [{"adminBearer": []}],
            "parameters": [{"name": "slot", "in": "path", "required": True, "schema": {"type": "string"}},
                           {"name": "action", "in": "query", "required": True,
                            "schema": {"type": "string", "enum": list(wire.SLOT_ACTIONS)}}],
            "requestBody": {"required": False, "content": {"application/json": {"schema": {
                "type": "object", "properties": {"filename": {
                    "type": "string", "maxLength": wire.MAX_FILENAME_CHARS}}}}}}}},
        "/tokenize": {"post": _post("a text's token ids (with pieces: each token's text), llama-server's shape",
                                    "TokenizeRequest", "the tokens", False, errors)},
        "/detokenize": {"post": _post("the text of token ids, llama-server's shape", "DetokenizeRequest",
                                      "the text", False, errors)},
        **_admin(errors),
        "/console/state": {"get": _get("the web console's data", "application/json", {"401": errors["401"]})},
        "/openapi.json": {"get": _get("this document", "application/json", {})},
    }


def _components() -> dict[str, Any]:
    return {
        "schemas": {"CompletionRequest": _completion(), "ChatRequest": _chat(), "EmbeddingRequest": _embedding(),
                    "ResponseRequest": _response(), "RerankRequest": _rerank(), "MessageRequest": _message(),
                    "TokenizeRequest": _tokenize(), "DetokenizeRequest": _detokenize(),
                    "AddModelRequest": _add_model(), "ScaleRequest": _bounds(),
                    "LoadAdapterRequest": _load_adapter(),
                    "Error": _ERROR, "AnthropicError": _ANTHROPIC_ERROR},
        "responses": {f"{prefix}{status}": {"description": why, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{shape}"}}}} for status, why in ERROR_STATUSES.items()
            for prefix, shape in (("E", "Error"), ("A", "AnthropicError"))},
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                            "adminBearer": {"type": "http", "scheme": "bearer",
                                            "description": "the admin key (--admin-key), never the API key"},
                            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}},
    }


def _generation(what: str, request: str, errors: dict[str, Any]) -> dict[str, Any]:
    return _post(f"OpenAI {what}, whole (JSON) or streamed (server-sent events)", request, "the completion", True,
                 errors)


def _post(summary: str, request: str, answer: str, streams: bool, errors: dict[str, Any]) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {"summary": summary, "security": [{"bearer": []}, {}],
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{request}"}}}},
            "responses": {"200": {"description": answer, "content": content}, **errors}}


def _get(what: str, media: str, errors: dict[str, Any]) -> dict[str, Any]:
    schema = {"type": "object"} if media == "application/json" else {"type": "string"}
    return {"summary": what, "responses": {"200": {"description": what, "content": {media: {"schema": schema}}},
                                           **errors}}


def _admin(errors: dict[str, Any]) -> dict[str, Any]:
    """The control API (``ops.admin``): its own key; 404 on every path while the gateway has none."""
    answers = {k: errors[k] for k in ("400", "404", "503")} | {"401": {
        "description": "no valid admin key", "content": {"application/json": {"schema": {
            "$ref": "#/components/schemas/Error"}}}}}
    security: list[dict[str, list[str]]] = [{"adminBearer": []}]

    def call(summary: str, body: str | None, required: bool = True) -> dict[str, Any]:
        operation = {**_get(summary, "application/json", answers), "security": security}
        if body is not None:
            operation["requestBody"] = {"required": required, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{body}"}}}}
        return operation

    return {
        "/admin/models": {"get": call("every model: its instances taking requests, starting and draining, its "
                                      "bounds and state", None),
                          "post": call("serve another model from a GGUF on the server's host", "AddModelRequest")},
        "/admin/models/{name}/{op}": {"post": {
            **call("load: start its instances; unload: drain them all; scale: new bounds", "ScaleRequest", False),
            "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}},
                           {"name": "op", "in": "path", "required": True,
                            "schema": {"type": "string", "enum": ["load", "unload", "scale"]}}]}},
        "/admin/adapters": {"get": call("each model's LoRA adapters, in the order of their ids", None),
                            "post": call("load a LoRA adapter (a GGUF on the server's host) into every instance of "
                                         "a model", "LoadAdapterRequest")},
        "/admin/adapters/{model}/{name}": {"delete": {
            **call("unload a LoRA adapter once the requests using it have finished", None),
            "parameters": [{"name": key, "in": "path", "required": True, "schema": {"type": "string"}}
                           for key in ("model", "name")]}},
    }


def _sampling() -> dict[str, Any]:
    stop = {"type": "string", "minLength": 1, "maxLength": wire.MAX_STOP_CHARS}
    return {
        "model": nullable({"type": "string", "maxLength": 256}),
        "max_tokens": nullable({"type": "integer", "minimum": 1, "maximum": wire.MAX_TOKENS_LIMIT}),
        "temperature": nullable({"type": "number", "minimum": 0, "maximum": 100}),
        "top_p": nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "top_k": nullable({"type": "integer", "minimum": 0, "maximum": 1 << 20}),
        "seed": nullable({"type": "integer", "minimum": 0, "maximum": 2**32 - 1}),
        "repeat_penalty": nullable({"type": "number", "minimum": 0.01, "maximum": 100}),
        "stop": nullable({"oneOf": [stop, {"type": "array", "items": stop, "maxItems": oai.MAX_STOP_STRINGS}]}),
        "stream": nullable({"type": "boolean"}),
        "stream_options": nullable({"type": "object", "properties": {"include_usage": {"type": "boolean"}},
                                     "additionalProperties": False}),
        "user": nullable({"type": "string"}),
        "n": nullable({"type": "integer", "minimum": 1, "maximum": wire.MAX_CHOICES}),
        **fields.sampling(), **fields.structured(), **fields.pipeline(), **fields.llama_server(),
        **fields.unsupported(oai.UNSUPPORTED),
    }


def _completion() -> dict[str, Any]:
    prompt = {"type": "string", "maxLength": wire.MAX_PROMPT_CHARS}
    return {"type": "object", "required": ["prompt"], "additionalProperties": False, "properties": {
        "prompt": {"oneOf": [prompt, {"type": "array", "items": prompt, "minItems": 1, "maxItems": 1}]},
        "logprobs": nullable({"type": "integer", "minimum": 0, "maximum": wire.MAX_TOP_LOGPROBS}),
        "echo": nullable({"type": "boolean"}),
        "best_of": nullable({"type": "integer", "minimum": 1, "maximum": wire.MAX_CHOICES}),
        **_sampling()}}


def _chat() -> dict[str, Any]:
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
    call = {"type": "object", "required": ["function"], "properties": {
        "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "arguments": {"type": "string"}}}}}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string", "enum": list(oai.CHAT_ROLES)},
        "content": nullable({"oneOf": [{"type": "string"}, {"type": "array", "items": part}]}),
        "tool_calls": nullable({"type": "array", "items": call}), "tool_call_id": {"type": "string"}}}
    return {"type": "object", "required": ["messages"], "additionalProperties": False, "properties": {
        "messages": {"type": "array", "items": message, "minItems": 1, "maxItems": limits.MAX_MESSAGES},
        "max_completion_tokens": nullable({"type": "integer", "minimum": 1, "maximum": wire.MAX_TOKENS_LIMIT}),
        "logprobs": nullable({"type": "boolean"}),
        "top_logprobs": nullable({"type": "integer", "minimum": 0, "maximum": wire.MAX_TOP_LOGPROBS}),
        **_sampling(), **fields.chat_tools(), **fields.chat_reasoning()}}


def _embedding() -> dict[str, Any]:
    text = {"type": "string", "minLength": 1, "maxLength": wire.MAX_PROMPT_CHARS}
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": wire.MAX_TOKEN_ID}, "minItems": 1,
           "maxItems": wire.MAX_PROMPT_CHARS}
    many = {"minItems": 1, "maxItems": wire.MAX_EMBED_INPUTS}
    return {"type": "object", "required": ["input"], "additionalProperties": False, "properties": {
        "input": {"oneOf": [text, {"type": "array", "items": text, **many}, ids,
                            {"type": "array", "items": ids, **many}]},
        "model": nullable({"type": "string", "maxLength": 256}),
        "encoding_format": nullable({"type": "string", "enum": list(emb.FORMATS)}),
        "user": nullable({"type": "string"}),
        **fields.unsupported({"dimensions": ((), "a model's embeddings have its own size")})}}


def _response() -> dict[str, Any]:
    text = {"type": "string", "maxLength": wire.MAX_PROMPT_CHARS}
    part = {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"type": "string", "enum": ["input_text", "output_text"]}, "text": text}}
    item = {"oneOf": [
        {"type": "object", "required": ["role", "content"], "properties": {
            "type": {"type": "string", "enum": ["message"]},
            "role": {"type": "string", "enum": list(responses.ROLES)},
            "content": {"oneOf": [text, {"type": "array", "items": part}]}}},
        {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
            "type": {"type": "string", "enum": ["function_call"]}, "call_id": {"type": "string"},
            "name": {"type": "string"}, "arguments": {"type": "string"}}},
        {"type": "object", "required": ["type", "call_id", "output"], "properties": {
            "type": {"type": "string", "enum": ["function_call_output"]}, "call_id": {"type": "string"},
            "output": text}}]}
    tool = {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"type": "string", "enum": ["function"]}, "name": {"type": "string", "pattern": TOOL_NAME},
        "description": {"type": "string"}, "parameters": {"type": "object"}, "strict": nullable({"type": "boolean"})}}
    return {"type": "object", "required": ["input"], "additionalProperties": False, "properties": {
        "model": nullable({"type": "string", "maxLength": 256}),
        "input": {"oneOf": [text, {"type": "array", "items": item, "minItems": 1, "maxItems": limits.MAX_MESSAGES}]},
        "instructions": nullable(text),
        "max_output_tokens": nullable({"type": "integer", "minimum": 1, "maximum": wire.MAX_TOKENS_LIMIT}),
        "temperature": nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "tools": nullable({"type": "array", "items": tool, "maxItems": tc.MAX_TOOLS}),
        "tool_choice": nullable({"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {
            "type": "object", "required": ["type", "name"], "properties": {
                "type": {"type": "string", "enum": ["function"]}, "name": {"type": "string"}}}]}),
        "parallel_tool_calls": nullable({"type": "boolean"}),
        "text": nullable({"type": "object", "properties": {"format": {
            "type": "object", "required": ["type"], "properties": {
                "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]}}}}}),
        "stream": nullable({"type": "boolean"}), "store": nullable({"type": "boolean"}),
        "background": nullable({"type": "boolean"}),
        "reasoning": nullable({"type": "object", "properties": {
            "effort": nullable({"type": "string", "enum": list(reasoning.EFFORTS)}),
            "summary": nullable({"type": "string"}), "generate_summary": nullable({"type": "string"})},
            "description": "the thinking's effort (its budget; none: no thinking); a summary is not made"}),
        "reasoning_budget": fields.budget("mpserve's: most tokens the thinking takes before its end tag is forced"),
        "previous_response_id": nullable({"type": "string"}),
        "metadata": nullable({"type": "object", "additionalProperties": {"type": "string"}, "maxProperties": 16}),
        "user": nullable({"type": "string"}),
        "stream_options": _sampling()["stream_options"], **fields.pipeline(),
        **fields.ignored(("safety_identifier", "prompt_cache_key", "prompt_cache_retention", "max_tool_calls"),
                         "OpenAI"),
        **fields.unsupported(responses.UNSUPPORTED)}}


def _message() -> dict[str, Any]:
    text = {"type": "string", "maxLength": wire.MAX_PROMPT_CHARS}
    block = {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]},
        "text": text, "id": {"type": "string"}, "name": {"type": "string"}, "input": {"type": "object"},
        "tool_use_id": {"type": "string"}, "content": {"type": "string"}, "thinking": {"type": "string"},
        "signature": {"type": "string"}}}
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": ["user", "assistant"]},
        "content": {"oneOf": [text, {"type": "array", "items": block}]}}}
    tool = {"type": "object", "required": ["name", "input_schema"], "properties": {
        "name": {"type": "string", "pattern": TOOL_NAME}, "description": {"type": "string"},
        "input_schema": {"type": "object"}}}
    stop = {"type": "string", "minLength": 1, "maxLength": wire.MAX_STOP_CHARS}
    return {"type": "object", "required": ["max_tokens", "messages"], "additionalProperties": False, "properties": {
        "model": {"type": "string", "maxLength": 256},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": wire.MAX_TOKENS_LIMIT},
        "messages": {"type": "array", "items": message, "minItems": 1, "maxItems": limits.MAX_MESSAGES},
        "system": {"oneOf": [text, {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                                                "properties": {"type": {"enum": ["text"]},
                                                                               "text": text}}}]},
        "stop_sequences": {"type": "array", "items": stop, "maxItems": oai.MAX_STOP_STRINGS},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0, "maximum": 1 << 20},
        "stream": {"type": "boolean"},
        "tools": {"type": "array", "items": tool, "maxItems": tc.MAX_TOOLS},
        "tool_choice": {"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"},
            "disable_parallel_tool_use": {"type": "boolean"}}},
        "metadata": {"type": "object"},
        "thinking": {"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["enabled", "adaptive", "disabled"]},
            "budget_tokens": fields.budget("most tokens the thinking takes (enabled)")},
            "description": "enabled with its budget, adaptive (the model's budget) or disabled; not given: the "
                           "template's default"},
        "output_config": {"type": "object", "properties": {"format": {
            "type": "object", "required": ["type", "schema"], "properties": {
                "type": {"type": "string", "enum": ["json_schema"]}, "schema": {"type": "object"}}}}},
        **fields.pipeline(),
        **fields.ignored(("cache_control", "diagnostics", "inference_geo", "service_tier", "speed",
                          "user_profile_id", "workspace_id"), "Anthropic"),
        **fields.unsupported(messages.UNSUPPORTED)}}


def _rerank() -> dict[str, Any]:
    text = {"type": "string", "minLength": 1, "maxLength": wire.MAX_PROMPT_CHARS}
    document = {"oneOf": [text, {"type": "object", "required": ["text"], "properties": {"text": text}}]}
    return {"type": "object", "required": ["query", "documents"], "additionalProperties": False, "properties": {
        "model": nullable({"type": "string", "maxLength": 256}), "query": text,
        "documents": {"type": "array", "items": document, "minItems": 1, "maxItems": wire.MAX_EMBED_INPUTS},
        "top_n": nullable({"type": "integer", "minimum": 1}), "return_documents": nullable({"type": "boolean"}),
        "user": nullable({"type": "string"})}}


def _tokenize() -> dict[str, Any]:
    return {"type": "object", "required": ["content"], "additionalProperties": False, "properties": {
        "content": {"type": "string", "maxLength": wire.MAX_PROMPT_CHARS},
        "add_special": nullable({"type": "boolean"}), "with_pieces": nullable({"type": "boolean"}),
        "model": nullable({"type": "string", "maxLength": 256})}}


def _detokenize() -> dict[str, Any]:
    return {"type": "object", "required": ["tokens"], "additionalProperties": False, "properties": {
        "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": wire.MAX_TOKEN_ID},
                   "maxItems": wire.MAX_PROMPT_CHARS},
        "model": nullable({"type": "string", "maxLength": 256})}}


def _bounds() -> dict[str, Any]:
    """A model's instance bounds (``scale``; ``load`` and ``unload`` take no body)."""
    return {"type": "object", "additionalProperties": False, "properties": {
        "min": {"type": "integer", "minimum": 0, "maximum": wire.MAX_INSTANCES},
        "max": {"type": "integer", "minimum": 1, "maximum": wire.MAX_INSTANCES}}}


def _add_model() -> dict[str, Any]:
    bounds = _bounds()
    return {**bounds, "required": ["path"], "properties": {
        **bounds["properties"], "path": {"type": "string", "minLength": 1, "maxLength": 4096},
        "name": {"type": "string", "minLength": 1, "maxLength": 256}}}


def _load_adapter() -> dict[str, Any]:
    text = {"type": "string", "minLength": 1, "maxLength": 4096}
    return {"type": "object", "additionalProperties": False, "required": ["model", "name", "path"],
            "properties": {"model": text, "name": {"type": "string", "pattern": wire.ADAPTER_NAME_PATTERN},
                           "path": text}}


_ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
_ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"type": "string", "enum": ["error"]}, "error": {"type": "object", "required": ["type", "message"],
                                                            "properties": {"type": {"type": "string"},
                                                                           "message": {"type": "string"}}}}}
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"nullable": True},
        "code": {"type": "string"}}}}}
