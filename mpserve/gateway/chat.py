"""Chat templates: the one a GGUF carries (``tokenizer.chat_template``, Jinja2), read where the model is
loaded (``mpserve.engine.model_info``) and rendered here, where chat requests arrive.

A worker reads its model's template, with the BOS and EOS token texts templates refer to, and sends them in
READY; the broker keeps them per model and hands them out in STATS; the HTTP gateway renders a chat
request's messages with them (``render``), as Hugging Face's tokenizers and llama-cpp-python do: a
sandboxed Jinja2 environment, ``messages`` as role/content mappings, ``add_generation_prompt`` true. The
engines add BOS themselves when they tokenize a prompt, so templates get an empty ``bos_token``: a
template that starts with it would otherwise give the model two.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from mpserve.errors import BadRequest
from mpserve.wire.protocol import ChatTemplate


def render(chat: ChatTemplate, messages: Sequence[tuple[str, str] | dict[str, Any]],
           tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt for ``messages`` ((role, content), or Hugging Face's message mappings, with tool calls),
    ending where the assistant's reply begins; ``tools`` (OpenAI's function list) is the template's ``tools``
    variable, left undefined when None. A template that fails, or refuses the conversation with
    ``raise_exception``, is a BadRequest naming why."""
    import jinja2

    extra = {"tools": tools} if tools is not None else {}
    try:
        prompt: str = _compiled(chat.template).render(
            messages=[m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in messages],
            add_generation_prompt=True, bos_token="", eos_token=chat.eos_token, **extra)
        return prompt
    except jinja2.TemplateError as exc:
        raise BadRequest(f"the model's chat template failed: {exc}") from None


@functools.lru_cache(maxsize=16)
def _compiled(source: str) -> Any:
    """A template compiled once, not on every chat request (a model's template is kilobytes of Jinja)."""
    import jinja2.ext
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)


def _raise_exception(message: str) -> None:
    raise BadRequest(f"the model's chat template refused the messages: {message}")
