"""OpenAI's HTTP shapes: request bodies in, mpserve parameters out; results out in OpenAI's form (its errors:
``http.errors``).

No I/O here, so that the pipeline (``dialect``) only serves and this mapping can be read (and tested) alone.

Parameters. ``max_tokens`` (chat also ``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``,
``stop`` (a string or a list), ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` (token id to
bias) map one to one; ``top_k``, ``repeat_penalty``, ``min_p``, ``typical_p`` and ``ignore_eos`` are taken
too (llama.cpp's and llama-server's names), and ``speculative_n_max`` (drafts a step; 0: no speculation).
They are then checked by ``protocol.GenerateParams``, so the
HTTP and ZeroMQ paths refuse the same values with the same words. ``logprobs`` (chat: with ``top_logprobs``)
come back in OpenAI's shapes (``logprobs``). ``echo`` (completions) puts the prompt before the
completion and, with ``logprobs``, its tokens' log-probabilities before the completion's (the first one's
null, as OpenAI sends it; text offsets from the start of the prompt). ``n`` choices run together in one
instance, which computes the prompt once; choice i is seeded with ``seed + i``; each comes with its index
(streamed: each chunk too), tool calls read per choice; ``best_of`` (completions) returns the n best of
that many (``best_of``). What mpserve cannot do (``suffix``, ...) is refused with 400 naming the
parameter, unless it is sent at its neutral value (``suffix: ""``, ...), which clients often do.
llama-server's extensions (``cache_prompt``, ``n_predict``, ``n_probs``, ...) are mapped or ignored as
``extensions`` says; other unrecognised keys are refused like OpenAI refuses them. A ``null`` value
means "not given".

Defaults are OpenAI's (``OPENAI_DEFAULTS``): what a request leaves out is sampled at temperature 1 with
top_p 1, no top-k and no repeat penalty, so a request sent here as to OpenAI's API samples alike (llama.cpp's
min-p 0.05 stays). The ZeroMQ client keeps llama.cpp's defaults (``protocol.GenerateParams``).

Chat prompts are formatted with the model's own chat template, from its GGUF (``Call.with_chat_template``,
``mpserve.gateway.api.chat``: within a time and output budget, off the event loop); a model without one gets a
ChatML default (``chat_prompt``), which also stops generation at ``<|im_end|>``.

Structured output: ``response_format`` ``{"type": "json_object"}`` (any JSON object) or ``{"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}``, and llama-server's ``grammar`` (GBNF) and
``json_schema`` extensions, become ``GenerateParams.json_schema`` / ``grammar`` (checked and compiled by
``mpserve.structured``, as on the ZeroMQ path). Tools (chat): ``tools``, ``tool_choice`` and
``parallel_tool_calls`` as ``mpserve.gateway.api.tools`` describes; history messages may carry assistant
``tool_calls`` and ``role: "tool"`` answers.

Reasoning (chat): where the model's template thinks, ``reasoning_effort``, ``reasoning_budget``,
``chat_template_kwargs`` and ``reasoning_format`` say how (``reasoning``); the reply's thinking comes back as
``message.reasoning_content`` (streamed: ``delta.reasoning_content``) and its tokens as
``usage.completion_tokens_details.reasoning_tokens``; tool calls and structured output are read from the content.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from mpserve.client import Result
from mpserve.errors import BadRequest
from mpserve.families import FAMILIES
from mpserve.families.stream import CallStream, Delta
from mpserve.structured import JSON_OBJECT_SCHEMA, canonical_json
from mpserve.wire import protocol as wire
from mpserve.wire.media import WithImages
from mpserve.wire.protocol import ChatTemplate

from . import best_of, extensions, images, logprobs, reasoning
from . import tools as tc
from .chat import Renderer
from .tokens import token_ids

log = logging.getLogger("mpserve.gateway")

Kind = Literal["completion", "chat"]

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat uses mpserve's default
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repeat_penalty": 1.0}  # top_k 0: off
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
CHAT_STOP = "<|im_end|>"
# A chat without its model's template also stops at CHAT_STOP: one of the protocol's stop strings is kept for it
MAX_STOP_STRINGS = wire.MAX_STOP_STRINGS - 1

_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "repeat_penalty",
             "presence_penalty", "frequency_penalty", "logit_bias", "min_p", "typical_p", "ignore_eos", "n",
             "speculative_n_max")
_COMMON = ("model", "stream", "stream_options", "user", "response_format", "grammar", "json_schema", "lora") + _SAMPLING
FIELDS: dict[Kind, frozenset[str]] = {
    "completion": frozenset(_COMMON + ("prompt", "logprobs", "echo", "best_of")),
    "chat": frozenset(_COMMON + ("messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                                  "tool_choice", "parallel_tool_calls", "reasoning_effort", "reasoning_budget",
                                  "chat_template_kwargs", "reasoning_format")),
}
Unsupported = dict[str, tuple[tuple[Any, ...], str]]
"""Fields an API has that mpserve does not implement: the values that ask for nothing (accepted), and why
others are refused."""


UNSUPPORTED: Unsupported = {
    "suffix": (("",), "insertion (suffix) is not supported"),
    "functions": (([],), "the deprecated function calls are not supported; use tools"),
    "function_call": (("none",), "the deprecated function calls are not supported; use tool_choice"),
}


@dataclass(frozen=True)
class Call:
    """One OpenAI request, checked and translated for mpserve."""

    kind: Kind
    model: str | None
    prompt: str | list[int] | WithImages  # token ids for a completion given them; a chat's: "" until
    # with_chat_template, then its text, with the images its messages carry if they do (``images``)
    params: wire.GenerateParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk carries the usage
    messages: tuple[Message, ...] = ()  # a chat's
    tools: tc.ToolSpec | None = None  # a chat's tools, when one may be called
    parser: tc.Parser = "hermes"  # how its reply's tool calls are read (from the chat template)
    echo: bool = False  # a completion's: the prompt comes back before the completion
    echo_text: str = ""  # the prompt's text: a token prompt's is set by with_echo_text
    best: best_of.BestOf | None = None  # a completion's best_of: the n of its choices to return
    ignored: tuple[str, ...] = ()  # llama-server's extensions it carried that do not apply (``extensions``)
    lora: list[Any] | None = None  # llama-server's LoRA adapters, [{"id": 0, "scale": 0.5}] (``api.adapters``)
    thinking: reasoning.Ask = reasoning.Ask()  # a chat's: the thinking it asks for
    reasoning_end: str = ""  # a chat's reply thinks, its text split at this end tag (with_chat_template)

    def headers(self) -> dict[str, str]:
        """The response's headers: which of the request's fields were ignored."""
        return {extensions.HEADER: ", ".join(self.ignored)} if self.ignored else {}

    def shown(self, results: list[Result]) -> list[Result]:
        """The results to answer with: all of them, or with best_of the best n."""
        return best_of.pick(results, self.best) if self.best is not None else results

    async def _forced(self, parser: tc.Parser) -> wire.GenerateParams:
        """The parameters, with a forced call's grammar in family ``parser``'s format, compiled off the event loop
        (a tool's schema may take up to ``structured.MAX_COMPILE_S``); BadRequest for one that cannot compile."""
        if self.tools is None or not self.tools.forced:
            return self.params
        grammar = await asyncio.to_thread(tc.forced_grammar, self.tools, parser)
        params = msgspec.structs.replace(self.params, grammar=grammar)
        params.validate()
        return params

    def with_echo_text(self, text: str) -> Call:
        return dataclasses.replace(self, echo_text=text)

    async def with_chat_template(self, chat: ChatTemplate, renderer: Renderer, model: str) -> Call:
        """A chat's prompt from ``model``'s template, rendered by ``renderer`` (off the event loop); without one,
        from the ChatML default, which also stops at ``<|im_end|>``. Raises BadRequest when the template fails,
        refuses the messages or goes over its budget."""
        tags, ask = reasoning.tags_of(chat.template), self.thinking
        forced = await self._forced(tc.parser_for(chat.template))  # BadRequest: a tool's schema that cannot compile
        params, thinks = ask.params(tags, forced)  # BadRequest: thinking asked of a template that does not
        if chat:
            messages = [m.for_template() for m in self.messages]
            if self.tools is not None and "tools" not in chat.template:  # it cannot show them: the default prompt
                messages = _with_system(messages, tc.tools_prompt(self.tools))
            tools = [t.as_openai() for t in self.tools.tools] if self.tools is not None else None
            prompt = await renderer.render(chat, messages, tools, model, ask.template_variables())
            return dataclasses.replace(self, prompt=images.with_images(ask.prompt(tags, prompt), self.chat_images()),
                                       params=params,
                                       parser=tc.parser_for(chat.template),
                                       reasoning_end=tags.end if thinks and tags and ask.split else "")
        stop = self.params.stop if CHAT_STOP in self.params.stop else (*self.params.stop, CHAT_STOP)
        sent = images.with_images(chat_prompt(self.messages, self.tools), self.chat_images())
        return dataclasses.replace(self, prompt=sent, params=msgspec.structs.replace(forced, stop=stop))

    def chat_images(self) -> tuple[bytes, ...]:
        """A chat's images, in the order of its messages and their parts."""
        return tuple(image for m in self.messages for image in m.images)


def parse(kind: Kind, body: Any) -> Call:
    """Check an OpenAI request body; raises BadRequest with a message that names the culprit."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    body, ignored = extensions.translate(kind == "chat", body)
    given = given_fields(body, FIELDS[kind], UNSUPPORTED)
    model = given.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    stream = given.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    lora = given.get("lora")
    if lora is not None and not isinstance(lora, list):
        raise BadRequest("'lora' must be a list like [{\"id\": 0, \"scale\": 0.5}]")
    options = given.get("stream_options", {})
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise BadRequest("'stream_options' must be an object like {\"include_usage\": true}")
    sampling = {**OPENAI_DEFAULTS, **{k: given[k] for k in _SAMPLING if k in given}}
    top_logprobs = logprobs.requested(kind == "chat", given)
    if top_logprobs is not None:
        sampling["logprobs"] = top_logprobs
    echo = given.get("echo", False)
    if not isinstance(echo, bool):
        raise BadRequest("'echo' must be a boolean")
    if echo and top_logprobs is not None:
        sampling["prompt_logprobs"] = True
    best = best_of.requested(given, sampling, stream) if kind == "completion" else None
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    if isinstance(sampling.get("stop"), list) and len(sampling["stop"]) > MAX_STOP_STRINGS:
        raise BadRequest(f"'stop' takes at most {MAX_STOP_STRINGS} strings over HTTP (one more is kept for the chat "
                         f"template's end of turn), got {len(sampling['stop'])}")
    sampling |= _structured(given)
    spec = tc.parse_tools(given.get("tools"), given.get("tool_choice"), given.get("parallel_tool_calls"))
    if spec is not None and sampling.get("logprobs") is not None:  # a reply held back as a possible call has none
        raise BadRequest("'logprobs' cannot be combined with 'tools'")
    if spec is not None and spec.forced:
        if "json_schema" in sampling or "grammar" in sampling:
            raise BadRequest("'tool_choice' required or a named function cannot be combined with "
                             "'response_format', 'grammar' or 'json_schema'")
    if kind == "chat":
        if "max_completion_tokens" in given:
            sampling["max_tokens"] = given["max_completion_tokens"]
        messages = tuple(_messages(given.get("messages")))
        prompt: str | list[int] = ""
        thinking = reasoning.Ask.parse(given)
    else:
        sampling.setdefault("max_tokens", COMPLETION_MAX_TOKENS)
        messages, prompt, thinking = (), _prompt(given.get("prompt")), reasoning.Ask()
    return Call(kind, model, prompt, wire.GenerateParams.from_wire(sampling), stream,
                options.get("include_usage", False), messages, spec, echo=echo,
                echo_text=prompt if isinstance(prompt, str) else "", best=best, ignored=ignored, lora=lora,
                thinking=thinking)


def given_fields(body: dict[str, Any], known: frozenset[str], unsupported: Unsupported) -> dict[str, Any]:
    """The fields a body gives (null: not given); raises BadRequest for a key that is not ``known`` (nor
    ``unsupported``), and for an unsupported field at other than its neutral value."""
    unknown = sorted(set(body) - known - set(unsupported))
    if unknown:
        raise BadRequest(f"unrecognized request argument(s) supplied: {', '.join(unknown)}")
    given = {k: v for k, v in body.items() if v is not None}
    for key, (neutral, why) in unsupported.items():
        if key in given and given[key] not in neutral:
            raise BadRequest(f"'{key}' = {given[key]!r:.60} is not supported by mpserve: {why}")
    return given


def _structured(given: dict[str, Any]) -> dict[str, str]:
    """``json_schema`` / ``grammar`` parameters from ``response_format`` and llama-server's fields."""
    out: dict[str, str] = {}
    fmt = given.get("response_format", {"type": "text"})
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        out["json_schema"] = JSON_OBJECT_SCHEMA
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise BadRequest("'response_format' json_schema needs \"json_schema\": {\"name\": ..., \"schema\": {...}}")
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise BadRequest("'response_format.json_schema.schema' must be a JSON Schema object")
        out["json_schema"] = canonical_json(schema)
    elif kind != "text":
        raise BadRequest("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                         "{\"type\": \"json_schema\", \"json_schema\": {...}}")
    if "json_schema" in given:  # llama-server's extension: the schema itself
        if "json_schema" in out:
            raise BadRequest("give 'response_format' or 'json_schema', not both")
        out["json_schema"] = given["json_schema"] if isinstance(given["json_schema"], str) else \
            canonical_json(given["json_schema"])
    if "grammar" in given:
        out["grammar"] = given["grammar"]
    return out


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
    tool_calls: tuple[tc.ToolCall, ...] = ()  # an assistant's, in the history
    tool_call_id: str = ""  # a tool's answer: to which call
    images: tuple[bytes, ...] = ()  # the images its content places (its text holds a media marker for each)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (Hugging Face's shape: tool call arguments as objects)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": json.loads(c.arguments)}} for c in self.tool_calls]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
        return out


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The conversation as a template that shows no tools takes it: ``text`` (the tools prompt) at the end of the
    system message, or as a first system message; the tools' results as user turns (``_results_as_user_turns``)."""
    turns = _results_as_user_turns(messages)
    if turns and turns[0]["role"] == "system":
        return [{**turns[0], "content": f"{turns[0]['content']}\n\n{text}"}, *turns[1:]]
    return [{"role": "system", "content": text}, *turns]


def _results_as_user_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant's calls left out of its turn, and the results of the tool messages after it in one user turn
    that names each call's function and asks the last user question again (``tools.tool_results_turn``): a model
    taught no tool format answers from its result so, where it copies a result shown in tags, or calls again after
    its own call shown (docs/reasoning.md)."""
    turns: list[dict[str, Any]] = []
    results: list[tuple[str, str]] = []
    names: dict[str, str] = {}  # a call's id: its function
    question = "my question"
    for m in [*messages, None]:
        if m is not None and m["role"] == "tool":
            results.append((names.get(m.get("tool_call_id", ""), "call"), m["content"]))
            continue
        if results:
            turns.append({"role": "user", "content": tc.tool_results_turn(results, question)})
            results = []
        if m is not None:
            names |= {c["id"]: c["function"]["name"] for c in m.get("tool_calls", ())}
            question = m["content"] if m["role"] == "user" else question
            turns.append({k: v for k, v in m.items() if k != "tool_calls"})
    return turns


def _messages(value: Any) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise BadRequest("'messages' is required and must be a non-empty list")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise BadRequest(f"messages[{i}] must be an object whose 'role' is one of {', '.join(CHAT_ROLES)}")
        calls = tuple(_history_call(c, i) for c in m.get("tool_calls") or ()) if m["role"] == "assistant" else ()
        tool_call_id = m.get("tool_call_id", "")
        if m["role"] == "tool" and not isinstance(tool_call_id, str):
            raise BadRequest(f"messages[{i}].tool_call_id must be a string")
        text, pictures = images.content(m.get("content"), i)
        out.append(Message(m["role"], text, calls, tool_call_id if m["role"] == "tool" else "", pictures))
    return out


def _history_call(value: Any, i: int) -> tc.ToolCall:
    """An assistant's earlier tool call: {id, type: function, function: {name, arguments (JSON text)}}."""
    function = value.get("function") if isinstance(value, dict) else None
    if isinstance(function, dict) and isinstance(function.get("name"), str) and isinstance(value.get("id", ""), str):
        arguments = function.get("arguments", "{}")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            return tc.ToolCall(value.get("id", ""), function["name"], json.dumps(parsed, ensure_ascii=False))
    raise BadRequest(f"messages[{i}].tool_calls: each must be {{\"id\", \"type\": \"function\", \"function\": "
                     "{\"name\", \"arguments\": JSON object text}}")


def chat_prompt(messages: tuple[Message, ...], tools: tc.ToolSpec | None = None) -> str:
    """The default chat template (ChatML): ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`` per message, then
    ``<|im_start|>assistant\\n`` for the reply. Generation also stops at ``<|im_end|>`` (``CHAT_STOP``).
    With tools, ``tools.TOOLS_PROMPT`` ends the system message (Qwen 2.5's, asking for Hermes' ``<tool_call>``);
    with or without, the tools' results are user turns (``_results_as_user_turns``)."""
    turns = [m.for_template() for m in messages]
    turns = _with_system(turns, tc.tools_prompt(tools)) if tools is not None else _results_as_user_turns(turns)
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in turns)
    return f"{text}<|im_start|>assistant\n"


# --- responses ----------------------------------------------------------------------------------

@dataclass
class _ChoiceState:
    """What one choice's reply carries from chunk to chunk."""

    offset: int  # completions' text_offset
    echo: str  # text still to go before the choice's own
    null_first: bool  # the first echoed token's log-probability: null, as OpenAI sends it
    calls: CallStream | None  # a chat's reply read by its family as it streams (with tools, or Harmony's channels)
    split: reasoning.Split | None  # a thinking reply's split of its text
    role_sent: bool = False  # chat: the first delta carried the role
    ids: list[str] = dataclasses.field(default_factory=list)  # the ids of the calls streamed


class Reply:
    """Builds the response objects of one call: the whole response, or its stream chunks, each choice
    (``Result.index``, a chunk's ``index``) with its own state (``_ChoiceState``).

    With tools, a streamed reply is read by its family's parser as it comes (``tools.stream``): its content goes
    out as it comes, less what may open a call, and each call as ``delta.tool_calls`` chunks as it forms (its
    id and name once the name is known, then its arguments as they grow); a reply that held no call gives its
    held text as content at its end (never a forced reply: its calls only)."""

    def __init__(self, call: Call, model: str) -> None:
        self.call = call
        self.model = model
        prefix = "chatcmpl" if call.kind == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._object = "chat.completion" if call.kind == "chat" else "text_completion"
        self._choices: dict[int, _ChoiceState] = {}

    def _state(self, index: int) -> _ChoiceState:
        state = self._choices.get(index)
        if state is None:
            call = self.call
            state = self._choices[index] = _ChoiceState(
                len(call.prompt) if isinstance(call.prompt, str) and not call.echo else 0,
                call.echo_text if call.echo else "", call.echo, self._call_stream(),
                reasoning.Split(call.reasoning_end) if call.reasoning_end else None)
        return state

    def whole(self, results: list[Result], generated: list[Result] | None = None) -> dict[str, Any]:
        """``results`` as the response's choices; the usage counts ``generated`` (with best_of, more than shown);
        mpserve's timings (of the first choice) beside it, an extra key, as llama-server sends."""
        choices = []
        for r in results:
            lp = self._logprobs(r.logprobs, r.index)
            if self.call.kind == "chat":
                thought, text = reasoning.split(r.text, self.call.reasoning_end) if self.call.reasoning_end \
                    else ("", r.text)
                message: dict[str, Any] = {"role": "assistant", "content": FAMILIES[self.call.parser].content(text)}
                finish = r.finish_reason
                found = self._tool_calls(text, r.finish_reason)
                if found is not None and found[1]:
                    message = {"role": "assistant", "content": found[0] or None,
                               "tool_calls": [c.as_openai() for c in found[1]]}
                    finish = _calls_finish(finish)
                elif found is not None:  # a forced reply cut before its first call completed: no call, no text
                    message["content"] = found[0]
                if self.call.reasoning_end:
                    message["reasoning_content"] = thought
                choices.append({"index": r.index, "message": message, "logprobs": lp, "finish_reason": finish})
            else:
                choices.append({"index": r.index, "text": self._echoed(r.text, r.index), "logprobs": lp,
                                "finish_reason": r.finish_reason})
        return self._envelope(self._object, choices) | {
            "usage": usage(total_usage(generated or results), results[0].timings.cached_tokens),
            "timings": dataclasses.asdict(results[0].timings)}

    def chunks(self, text: str, lp: wire.Logprobs | None = None, index: int = 0) -> list[dict[str, Any]]:
        """The chunks for a piece of choice ``index``'s streamed text: none while it is held back (a request
        with tools carries no log-probabilities: the parse refuses the two together)."""
        state = self._state(index)
        thought = ""
        if state.split is not None:
            thought, text = state.split.push(text)
        out = [self._envelope(self._chunk_object, [self._delta({"reasoning_content": thought}, index) | {
            "logprobs": self._logprobs(lp, index) if not text else None}])] if thought else []
        if state.calls is not None:
            return out + self._call_chunks(state.calls.push(text), index)
        if state.split is not None and not text:
            return out
        return out + [self._envelope(self._chunk_object, [self._choice(text, None, index) | {
            "logprobs": self._logprobs(lp, index)}])]

    def last(self, results: list[Result], lps: dict[int, wire.Logprobs | None]) -> list[dict[str, Any]]:
        """Per choice, what was held back (tool calls or text) and the chunk with its finish reason (and the
        log-probabilities no chunk carried, ``lps`` by choice), then (if asked for) one with the usage and no
        choices; that one also carries mpserve's timings of the request (an extra key, as llama-server
        sends)."""
        chunks = []
        for r in results:
            state, finish = self._state(r.index), r.finish_reason
            thought = state.split.flush()[0] if state.split is not None else ""
            if thought:
                chunks.append(self._envelope(self._chunk_object, [self._delta({"reasoning_content": thought},
                                                                              r.index)]))
            if state.calls is not None:
                deltas, _ = state.calls.finish()
                chunks += self._call_chunks(deltas, r.index)
                finish = _calls_finish(finish) if state.ids else finish
                if self.call.tools is not None and self.call.tools.forced:
                    self._warn_cut(state.calls.text, finish)
            chunks.append(self._envelope(self._chunk_object, [self._choice("", finish, r.index) | {
                "logprobs": self._logprobs(lps.get(r.index), r.index)}]))
        if self.call.include_usage:
            chunks.append(self._envelope(self._chunk_object, []) | {
                "usage": usage(total_usage(results), results[0].timings.cached_tokens),
                "timings": dataclasses.asdict(results[0].timings)})
        return chunks

    def _logprobs(self, lp: wire.Logprobs | None, index: int) -> dict[str, Any] | None:
        if lp is None:
            return None
        if self.call.kind == "chat":
            return logprobs.chat(lp)
        state = self._state(index)
        shape, state.offset = logprobs.completion(lp, state.offset, state.null_first and lp.prompt > 0)
        state.null_first = state.null_first and lp.prompt == 0
        return shape

    def _tool_calls(self, text: str, finish: str) -> tuple[str, list[tc.ToolCall]] | None:
        """(content, calls) when the reply holds tool calls. A forced reply is always calls, never content: those
        its grammar wrote, or, cut by max_tokens (``finish``), the calls that completed before the cut (maybe
        none)."""
        tools = self.call.tools
        if tools is None:
            return None
        if tools.forced:
            calls, _ = tc.forced_calls(text, self.call.parser, tools.tools)
            self._warn_cut(text, finish)
            return "", calls
        content, calls = tc.parse_calls(text, self.call.parser, tools.tools)
        return (content, calls) if calls else None

    def _warn_cut(self, text: str, finish: str) -> None:
        tools = self.call.tools
        if tools is not None and tc.forced_calls(text, self.call.parser, tools.tools)[1]:
            log.warning("a reply constrained to tool calls ended (finish_reason %s) before its last call did: its "
                        "complete call(s) are returned, the unfinished one after them is dropped; a larger "
                        "max_tokens lets it finish", finish)

    def _call_stream(self) -> CallStream | None:
        """A chat's reader of its streamed reply: with tools, or a family of channels (whose content is read)."""
        call = self.call
        if call.kind != "chat" or (call.tools is None and not FAMILIES[call.parser].channels):
            return None
        return tc.stream(call.parser, call.tools)

    def _call_chunks(self, deltas: list[Delta], index: int) -> list[dict[str, Any]]:
        """The chunks of a stream's deltas: content (none in a forced reply), a call's opening (a new id, its name)
        or more of its arguments."""
        state, forced = self._state(index), self.call.tools is not None and self.call.tools.forced
        out = []
        for d in deltas:
            if d.name is not None:
                state.ids.append(tc.new_id())
                delta: dict[str, Any] = {"tool_calls": [{"index": d.index, "id": state.ids[-1], "type": "function",
                                                         "function": {"name": d.name, "arguments": ""}}]}
            elif d.index >= 0:
                delta = {"tool_calls": [{"index": d.index, "function": {"arguments": d.arguments}}]}
            elif forced:
                continue
            else:
                out.append(self._envelope(self._chunk_object, [self._choice(d.content, None, index)]))
                continue
            out.append(self._envelope(self._chunk_object, [self._delta(delta, index)]))
        return out

    def _delta(self, delta: dict[str, Any], index: int) -> dict[str, Any]:
        state = self._state(index)
        if not state.role_sent:
            delta = {"role": "assistant", **delta}
            state.role_sent = True
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}

    def _echoed(self, text: str, index: int) -> str:
        """``text``, after the prompt if it is still to be echoed in choice ``index``."""
        state = self._state(index)
        text, state.echo = state.echo + text, ""
        return text

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.call.kind == "chat" else "text_completion"

    def _choice(self, text: str, finish_reason: str | None, index: int) -> dict[str, Any]:
        if self.call.kind != "chat":
            return {"index": index, "text": self._echoed(text, index), "logprobs": None, "finish_reason": finish_reason}
        delta: dict[str, Any] = {"content": text} if text or not finish_reason else {}
        state = self._state(index)
        if not state.role_sent:
            delta["role"] = "assistant"
            state.role_sent = True
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}


def _calls_finish(finish: str) -> str:
    """The finish reason of a reply that holds tool calls: ``length`` when max_tokens cut it, as OpenAI says."""
    return finish if finish == "length" else "tool_calls"


def total_usage(results: list[Result]) -> wire.Usage:
    """The usage of a request's choices together: the prompt once (computed once), every choice's tokens."""
    return wire.Usage(results[0].usage.prompt_tokens, sum(r.usage.completion_tokens for r in results),
                      sum(r.usage.reasoning_tokens for r in results))


def usage(u: wire.Usage, cached: int) -> dict[str, Any]:
    """``u`` as OpenAI shows it; ``cached``: the prompt tokens taken from a cache instead of computed
    (``timings.cached_tokens``), counted in ``prompt_tokens`` too, as OpenAI counts them."""
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens}}
