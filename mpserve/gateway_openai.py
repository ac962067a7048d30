"""OpenAI's HTTP shapes: request bodies in, mpserve parameters out; results and errors out in OpenAI's form.

No I/O here, so that ``gateway.py`` keeps only the routing and this mapping can be read (and tested) alone.

Parameters. ``max_tokens`` (chat also ``max_completion_tokens``), ``temperature``, ``top_p``, ``seed`` and
``stop`` (a string or a list) map one to one; ``top_k`` and ``repeat_penalty`` are taken too (llama.cpp's
names). They are then checked by ``protocol.GenerateParams``, so the HTTP and ZeroMQ paths refuse the same
values with the same words. What mpserve cannot do (several choices, log-probabilities, tools, penalties
other than llama.cpp's, ...) is refused with 400 naming the parameter, unless it is sent at its neutral
value (``n: 1``, ``logprobs: null``, ...), which clients often do. Unrecognised keys are refused like
OpenAI refuses them. A ``null`` value means "not given".

Defaults are OpenAI's (``OPENAI_DEFAULTS``): what a request leaves out is sampled at temperature 1 with
top_p 1, no top-k and no repeat penalty, so a request sent here as to OpenAI's API samples alike (llama.cpp's
min-p 0.05 stays). The ZeroMQ client keeps llama.cpp's defaults (``protocol.GenerateParams``).

Chat prompts are formatted with the model's own chat template, from its GGUF (``Call.with_chat_template``,
``mpserve.chat_template``); a model without one gets a ChatML default (``chat_prompt``), which also stops
generation at ``<|im_end|>``.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from . import chat_template
from . import protocol as wire
from .chat_template import ChatTemplate
from .client import Result
from .errors import BadRequest, MpserveError

Kind = Literal["completion", "chat"]

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat uses mpserve's default
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repeat_penalty": 1.0}  # top_k 0: off
CHAT_ROLES = ("system", "developer", "user", "assistant")
CHAT_STOP = "<|im_end|>"

_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "repeat_penalty")
_COMMON = ("model", "stream", "stream_options", "user") + _SAMPLING
_KEYS: dict[Kind, frozenset[str]] = {
    "completion": frozenset(_COMMON + ("prompt",)),
    "chat": frozenset(_COMMON + ("messages", "max_completion_tokens")),
}
# Parameters mpserve does not implement, with the values that ask for nothing (accepted and ignored), and
# why a non-neutral value is refused.
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((1,), "one choice per request; send several requests instead"),
    "best_of": ((1,), "one choice per request"),
    "logprobs": ((False, 0), "log-probabilities are not returned"),
    "top_logprobs": ((0,), "log-probabilities are not returned"),
    "echo": ((False,), "the prompt is not echoed"),
    "suffix": (("",), "insertion (suffix) is not supported"),
    "logit_bias": (({},), "logit bias is not supported"),
    "presence_penalty": ((0,), "use repeat_penalty (llama.cpp's penalty) instead"),
    "frequency_penalty": ((0,), "use repeat_penalty (llama.cpp's penalty) instead"),
    "tools": (([],), "tool calls are not supported"),
    "tool_choice": (("none",), "tool calls are not supported"),
    "functions": (([],), "function calls are not supported"),
    "function_call": (("none",), "function calls are not supported"),
    "response_format": (({"type": "text"},), "only plain text responses are supported"),
}


@dataclass(frozen=True)
class Call:
    """One OpenAI request, checked and translated for mpserve."""

    kind: Kind
    model: str | None
    prompt: str  # a chat's: "" until with_chat_template
    params: wire.GenerateParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk carries the usage
    messages: tuple[Message, ...] = ()  # a chat's

    def generate_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``AsyncClient.generate`` / ``stream``."""
        return dict(vars(self.params))

    def with_chat_template(self, chat: ChatTemplate) -> Call:
        """A chat's prompt from the model's template; without one, from the ChatML default, which also stops
        at ``<|im_end|>``. Raises BadRequest when the template fails or refuses the messages."""
        if chat:
            return dataclasses.replace(self, prompt=chat_template.render(chat, [(m.role, m.content)
                                                                                 for m in self.messages]))
        stop = self.params.stop if CHAT_STOP in self.params.stop else (*self.params.stop, CHAT_STOP)
        return dataclasses.replace(self, prompt=chat_prompt(self.messages),
                                   params=dataclasses.replace(self.params, stop=stop))


def parse(kind: Kind, body: Any) -> Call:
    """Check an OpenAI request body; raises BadRequest with a message that names the culprit."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - _KEYS[kind] - set(_UNSUPPORTED))
    if unknown:
        raise BadRequest(f"unrecognized request argument(s) supplied: {', '.join(unknown)}")
    given = {k: v for k, v in body.items() if v is not None}
    for key, (neutral, why) in _UNSUPPORTED.items():
        if key in given and given[key] not in neutral:
            raise BadRequest(f"'{key}' = {given[key]!r:.60} is not supported by mpserve: {why}")
    model = given.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    stream = given.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    options = given.get("stream_options", {})
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise BadRequest("'stream_options' must be an object like {\"include_usage\": true}")
    sampling = {**OPENAI_DEFAULTS, **{k: given[k] for k in _SAMPLING if k in given}}
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    if kind == "chat":
        if "max_completion_tokens" in given:
            sampling["max_tokens"] = given["max_completion_tokens"]
        messages = tuple(_messages(given.get("messages")))
        prompt = ""
    else:
        sampling.setdefault("max_tokens", COMPLETION_MAX_TOKENS)
        messages, prompt = (), _prompt(given.get("prompt"))
    return Call(kind, model, prompt, wire.GenerateParams.from_wire(sampling), stream,
                options.get("include_usage", False), messages)


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, list):
        raise BadRequest("'prompt' must be one string (several prompts would be several choices; send several "
                         "requests)" if value and all(isinstance(v, str) for v in value) else
                         "'prompt' must be a string; token arrays are not supported")
    if not isinstance(value, str):
        raise BadRequest("'prompt' is required and must be a string")
    return value


@dataclass(frozen=True)
class Message:
    role: str
    content: str


def _messages(value: Any) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise BadRequest("'messages' is required and must be a non-empty list")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise BadRequest(f"messages[{i}] must be an object whose 'role' is one of {', '.join(CHAT_ROLES)}")
        out.append(Message(m["role"], _content(m.get("content"), i)))
    return out


def _content(value: Any, i: int) -> str:
    """A message's text: a string, or a list of text parts (images and audio are refused)."""
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts; other parts (images, "
                     "audio, files) are not supported")


def chat_prompt(messages: tuple[Message, ...]) -> str:
    """The default chat template (ChatML): ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`` per message, then
    ``<|im_start|>assistant\\n`` for the reply. Generation also stops at ``<|im_end|>`` (``CHAT_STOP``)."""
    turns = "".join(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in messages)
    return f"{turns}<|im_start|>assistant\n"


# --- responses ----------------------------------------------------------------------------------

class Reply:
    """Builds the response objects of one call: the whole response, or its stream chunks."""

    def __init__(self, call: Call, model: str) -> None:
        self.call = call
        self.model = model
        prefix = "chatcmpl" if call.kind == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._object = "chat.completion" if call.kind == "chat" else "text_completion"
        self._role_sent = False

    def whole(self, result: Result) -> dict[str, Any]:
        if self.call.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": result.text},
                                      "logprobs": None, "finish_reason": result.finish_reason}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}
        return self._envelope(self._object, [choice]) | {"usage": usage(result.usage)}

    def chunk(self, text: str) -> dict[str, Any]:
        return self._envelope(self._chunk_object, [self._choice(text, None)])

    def last(self, result: Result) -> list[dict[str, Any]]:
        """The chunk with the finish reason, then (if asked for) one with the usage and no choices."""
        chunks = [self._envelope(self._chunk_object, [self._choice("", result.finish_reason)])]
        if self.call.include_usage:
            chunks.append(self._envelope(self._chunk_object, []) | {"usage": usage(result.usage)})
        return chunks

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.call.kind == "chat" else "text_completion"

    def _choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        if self.call.kind != "chat":
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        delta: dict[str, Any] = {"content": text} if text or not finish_reason else {}
        if not self._role_sent:
            delta["role"] = "assistant"
            self._role_sent = True
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}


def usage(u: wire.Usage) -> dict[str, int]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens}


# --- errors -------------------------------------------------------------------------------------

# HTTP status per mpserve error code; anything else is 500.
STATUS: dict[str, int] = {
    "bad_request": 400,
    "protocol": 400,
    "unknown_model": 404,
    "busy": 429,
    "timeout": 504,
    "worker_lost": 502,
    "worker_stalled": 502,
    "shutting_down": 503,
    "model_failed": 503,
    "does_not_fit": 503,
    "connection": 503,
}


@dataclass(frozen=True)
class HttpError:
    """An error as OpenAI sends it: ``{"error": {"message", "type", "param", "code"}}``; ``code`` is the
    stable mpserve code (or a gateway one: ``invalid_api_key``, ``not_found``, ``method_not_allowed``)."""

    status: int
    code: str
    message: str
    retry_after: float | None = None

    @classmethod
    def from_mpserve(cls, exc: MpserveError) -> HttpError:
        return cls(STATUS.get(exc.code, 500), exc.code, exc.message, exc.retry_after)

    @property
    def type(self) -> str:
        if self.status == 401:
            return "authentication_error"
        if self.status == 429:
            return "rate_limit_error"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": None, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """``Retry-After`` (whole seconds, at least 1) on 429 and 503: both are worth retrying."""
        if self.status not in (429, 503):
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after or 1)))}
