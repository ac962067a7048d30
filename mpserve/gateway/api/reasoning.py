"""Reasoning: how a chat request asks for thinking, how its prompt opens it, and how the reply's text is split
into the thinking (``reasoning_content``) and the answer. No I/O here.

    request ──Ask.parse──▶ Ask: enabled, effort, budget, split (chat's reasoning_effort, reasoning_budget,
        chat_template_kwargs.enable_thinking, reasoning_format; Responses and Messages translate theirs to these)
    the model's chat template ──tags_of──▶ Tags (its <think> pair) or None: the template does not think
    the rendered prompt ──Ask.prompt──▶ thinking on: the prompt ends inside the thinking (the start tag appended
        where the template leaves it to the model), and GenerateParams.reasoning_end / budget / effort for the
        engine (``mpserve.engine.thinking``), which forces the end tag at the budget and applies the request's
        grammar after it; thinking off: a prompt that opened it is closed, so the reply is all answer
    the reply's text, whole or in pieces ──Split──▶ (reasoning, content) per piece

The split is made here, on the end tag in the text, not by the engine reporting each token's phase: the engine
puts the end tag into the text where the phase changed (a forced one too), so the text alone says where the
thinking ended, and whatever carries text agrees without another field on the wire: the whole reply and its
stream, every choice, and a stream replayed from its journal or taken over from a dead gateway process, whose
pieces are split again the same way. Every API (chat, Responses, Messages) reads the split from the chat
completion, its ``reasoning_content``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from mpserve import families
from mpserve.errors import BadRequest
from mpserve.wire import protocol as wire

EFFORTS = ("none", "minimal", "low", "medium", "high")
"""``reasoning_effort`` as OpenAI's clients send it: none turns thinking off, minimal is low."""
FORMATS = ("none", "deepseek", "auto")
"""llama-server's ``reasoning_format``: none leaves the thinking in the content; deepseek and auto split it."""
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
"""The variables the gateway gives a template itself, which ``chat_template_kwargs`` may not set."""


@dataclass(frozen=True)
class Tags:
    """A template family's thinking tags."""

    start: str
    end: str


THINK = Tags("<think>", "</think>")


def tags_of(template: str) -> Tags | None:
    """The thinking tags of a chat template that writes ``<think>`` (Qwen 3, DeepSeek R1, QwQ and their fine-tunes:
    in its generation prompt, or where it drops earlier thinking from the history), or of its family's own
    (gpt-oss's analysis channel, ``mpserve.families``); None for one that does not think."""
    own = families.for_template(template).thinking
    if own is not None:
        return Tags(*own)
    return THINK if THINK.start in template else None


@dataclass(frozen=True)
class Ask:
    """What a request asks of the thinking. ``enabled`` None: the template's own default (on); ``effort``: low,
    medium or high; ``budget``: tokens, over the effort's; ``split``: the thinking apart from the content;
    ``variables``: the request's ``chat_template_kwargs``; ``named``: the field that asked for thinking, for the
    refusal when the model's template does not think."""

    enabled: bool | None = None
    effort: str | None = None
    budget: int | None = None
    split: bool = True
    variables: tuple[tuple[str, Any], ...] = ()
    named: str = ""

    @classmethod
    def parse(cls, given: dict[str, Any]) -> Ask:
        """The thinking a chat body asks for; BadRequest naming the field for a bad value."""
        variables = template_variables(given.get("chat_template_kwargs"))
        enabled = dict(variables).get("enable_thinking")
        if enabled is not None and not isinstance(enabled, bool):
            raise BadRequest("'chat_template_kwargs.enable_thinking' must be a boolean")
        effort, named = given.get("reasoning_effort"), ""
        if effort is not None:
            if effort not in EFFORTS:
                raise BadRequest(f"'reasoning_effort' must be one of {', '.join(EFFORTS)}, got {str(effort)!r:.40}")
            enabled, named = (False, "") if effort == "none" else (enabled, "reasoning_effort")
            effort = "low" if effort in ("none", "minimal") else effort
        budget = given.get("reasoning_budget")
        if budget is not None:
            budget_tokens(budget, "reasoning_budget")
            named = "reasoning_budget"
        fmt = given.get("reasoning_format", "auto")
        if fmt not in FORMATS:
            raise BadRequest(f"'reasoning_format' must be one of {', '.join(FORMATS)}, got {str(fmt)!r:.40}")
        return cls(enabled, effort, budget, fmt != "none", variables, named)

    def params(self, tags: Tags | None, params: wire.GenerateParams) -> tuple[wire.GenerateParams, bool]:
        """``params`` for a reply that thinks under ``tags`` (None: the template does not think), and whether it
        does; BadRequest naming the field that asked a template that does not think to."""
        if tags is None:
            if self.named or self.enabled:
                which = self.named or "chat_template_kwargs.enable_thinking"
                raise BadRequest(f"'{which}' asks for thinking, and this model's chat template does not think (it "
                                 "never writes <think>)")
            return params, False
        if self.enabled is False:
            return params, False
        thinking = msgspec.structs.replace(params, reasoning_end=tags.end, reasoning_budget=self.budget,
                                           reasoning_effort=self.effort)
        thinking.validate()
        return thinking, True

    def template_variables(self) -> dict[str, Any]:
        """The template's variables from the request: its ``chat_template_kwargs``, and ``enable_thinking`` false
        when the thinking is off (Qwen 3's templates then write an empty thinking)."""
        return dict(self.variables) | ({"enable_thinking": False} if self.enabled is False else {})

    def prompt(self, tags: Tags | None, prompt: str) -> str:
        """The rendered ``prompt`` ending inside the thinking when it is on, outside it when it is off."""
        if tags is None:
            return prompt
        opened = prompt.rfind(tags.start) > prompt.rfind(tags.end)
        if self.enabled is False:
            return f"{prompt}\n{tags.end}\n\n" if opened else prompt
        return prompt if opened else f"{prompt}{tags.start}\n"


def budget_tokens(value: Any, field: str) -> int:
    """A thinking budget in tokens (0 or more; the engine refuses one past the context)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"'{field}' must be a number of tokens, 0 or more, got {str(value)!r:.40}")
    if value > wire.MAX_TOKENS_LIMIT:
        raise BadRequest(f"'{field}' must be at most {wire.MAX_TOKENS_LIMIT} tokens, got {value}")
    return value


def template_variables(value: Any) -> tuple[tuple[str, Any], ...]:
    """``chat_template_kwargs``: more variables for the chat template, as llama-server takes them."""
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(isinstance(k, str) and k.isidentifier() for k in value):
        raise BadRequest("'chat_template_kwargs' must be an object of template variables, like "
                         "{\"enable_thinking\": false}")
    taken = sorted(TEMPLATE_VARIABLES & set(value))
    if taken:
        raise BadRequest(f"'chat_template_kwargs' may not set {', '.join(taken)}: the gateway sets them")
    return tuple(value.items())


class Split:
    """One reply's text split at its thinking's end tag, piece by piece: what may be the start of the tag, and
    the whitespace before it, is held until the next piece says; leading whitespace of the thinking and of the
    answer is dropped (a template writes newlines around its tags)."""

    __slots__ = ("_end", "thinking", "_held", "_started")

    def __init__(self, end: str, thinking: bool = True) -> None:
        self._end = end
        self.thinking = thinking
        self._held = ""
        self._started = [False, False]  # the thinking's, the answer's first visible character sent

    def push(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) of the next piece of text."""
        if not self.thinking:
            return "", self._opened(1, text)
        held = self._held + text
        at = held.find(self._end)
        if at >= 0:
            self.thinking, self._held = False, ""
            return self._opened(0, held[:at].rstrip()), self._opened(1, held[at + len(self._end):])
        keep = next((n for n in range(min(len(held), len(self._end) - 1), 0, -1) if self._end.startswith(held[-n:])),
                    0)
        body = held[:len(held) - keep]
        shown = body.rstrip()
        self._held = held[len(shown):]
        return self._opened(0, shown), ""

    def flush(self) -> tuple[str, str]:
        """What is held at the reply's end: thinking the end tag never closed."""
        held, self._held = self._held, ""
        return (self._opened(0, held.rstrip()), "") if self.thinking else ("", "")

    def _opened(self, part: int, text: str) -> str:
        if not self._started[part]:
            text = text.lstrip()
            self._started[part] = bool(text)
        return text


def split(text: str, end: str) -> tuple[str, str]:
    """A whole reply's (reasoning, content)."""
    parts = Split(end)
    reasoning, content = parts.push(text)
    rest = parts.flush()
    return reasoning + rest[0], content + rest[1]
