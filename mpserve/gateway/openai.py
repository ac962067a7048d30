"""OpenAI's HTTP shapes: request bodies in, mpserve parameters out; results and errors out in OpenAI's form.

No I/O here, so that ``gateway.py`` keeps only the routing and this mapping can be read (and tested) alone.

Parameters. ``max_tokens`` (chat also ``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``,
``stop`` (a string or a list), ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` (token id to
bias) map one to one; ``top_k``, ``repeat_penalty``, ``min_p``, ``typical_p`` and ``ignore_eos`` are taken
too (llama.cpp's and llama-server's names). They are then checked by ``protocol.GenerateParams``, so the
HTTP and ZeroMQ paths refuse the same values with the same words. ``logprobs`` (chat: with ``top_logprobs``)
come back in OpenAI's shapes (``gateway.logprobs``). What mpserve cannot do (several choices, echo, tools,
...) is refused with 400 naming the parameter, unless it is sent at its neutral
value (``n: 1``, ``logprobs: null``, ...), which clients often do. Unrecognised keys are refused like
OpenAI refuses them. A ``null`` value means "not given".

Chat prompts are formatted with the model's own chat template, from its GGUF (``Call.with_chat_template``,
``mpserve.gateway.chat``); a model without one gets a ChatML default (``chat_prompt``), which also stops
generation at ``<|im_end|>``.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from mpserve import protocol as wire
from mpserve.client import Result
from mpserve.errors import BadRequest, MpserveError, http_status
from mpserve.protocol import ChatTemplate

from . import logprobs
from .chat import render
from .tokens import token_ids

Kind = Literal["completion", "chat"]

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat uses mpserve's default
CHAT_ROLES = ("system", "developer", "user", "assistant")
CHAT_STOP = "<|im_end|>"

_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "repeat_penalty",
             "presence_penalty", "frequency_penalty", "logit_bias", "min_p", "typical_p", "ignore_eos")
_COMMON = ("model", "stream", "stream_options", "user") + _SAMPLING
_KEYS: dict[Kind, frozenset[str]] = {
    "completion": frozenset(_COMMON + ("prompt", "logprobs")),
    "chat": frozenset(_COMMON + ("messages", "max_completion_tokens", "logprobs", "top_logprobs")),
}
# Parameters mpserve does not implement, with the values that ask for nothing (accepted and ignored), and
# why a non-neutral value is refused.
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((1,), "one choice per request; send several requests instead"),
    "best_of": ((1,), "one choice per request"),
    "echo": ((False,), "the prompt is not echoed (nor its log-probabilities)"),
    "suffix": (("",), "insertion (suffix) is not supported"),
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
    prompt: str | list[int]  # token ids for a completion given them; a chat's: "" until with_chat_template
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
            return dataclasses.replace(self, prompt=render(chat, [(m.role, m.content)
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
    sampling = {k: given[k] for k in _SAMPLING if k in given}
    top_logprobs = logprobs.requested(kind == "chat", given)
    if top_logprobs is not None:
        sampling["logprobs"] = top_logprobs
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    if kind == "chat":
        if "max_completion_tokens" in given:
            sampling["max_tokens"] = given["max_completion_tokens"]
        messages = tuple(_messages(given.get("messages")))
        prompt: str | list[int] = ""
    else:
        sampling.setdefault("max_tokens", COMPLETION_MAX_TOKENS)
        messages, prompt = (), _prompt(given.get("prompt"))
    return Call(kind, model, prompt, wire.GenerateParams.from_wire(sampling), stream,
                options.get("include_usage", False), messages)


def _prompt(value: Any) -> str | list[int]:
    """One prompt: a string, or token ids (also either one alone in a list)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return token_ids(value, "prompt")
    if isinstance(value, list):
        raise BadRequest("'prompt' must be one string or one list of token ids (several prompts would be several "
                         "choices; send several requests)")
    if not isinstance(value, str):
        raise BadRequest("'prompt' is required and must be a string or a list of token ids")
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
        self._offset = len(call.prompt) if isinstance(call.prompt, str) else 0  # completions' text_offset

    def whole(self, result: Result) -> dict[str, Any]:
        if self.call.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": result.text},
                                      "logprobs": self._logprobs(result.logprobs),
                                      "finish_reason": result.finish_reason}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": self._logprobs(result.logprobs),
                      "finish_reason": result.finish_reason}
        return self._envelope(self._object, [choice]) | {"usage": usage(result.usage)}

    def chunk(self, text: str, lp: wire.Logprobs | None = None) -> dict[str, Any]:
        return self._envelope(self._chunk_object, [self._choice(text, None) | {"logprobs": self._logprobs(lp)}])

    def last(self, result: Result, lp: wire.Logprobs | None = None) -> list[dict[str, Any]]:
        """The chunk with the finish reason (and the log-probabilities no chunk carried), then (if asked for)
        one with the usage and no choices; that one also carries mpserve's timings of the request (an extra key,
        as llama-server sends)."""
        finish = self._choice("", result.finish_reason) | {"logprobs": self._logprobs(lp)}
        chunks = [self._envelope(self._chunk_object, [finish])]
        if self.call.include_usage:
            chunks.append(self._envelope(self._chunk_object, []) | {"usage": usage(result.usage),
                                                                     "timings": dataclasses.asdict(result.timings)})
        return chunks

    def _logprobs(self, lp: wire.Logprobs | None) -> dict[str, Any] | None:
        if lp is None:
            return None
        if self.call.kind == "chat":
            return logprobs.chat(lp)
        shape, self._offset = logprobs.completion(lp, self._offset)
        return shape

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
        return cls(http_status(exc.code), exc.code, exc.message, exc.retry_after)

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
