"""Which chat template a model is served with: the ``chat_template`` setting (a family's NAME or a Jinja2
file's PATH), else the GGUF's own ``tokenizer.chat_template``, else its family's, chosen by the GGUF's
``general.architecture`` (said once in the log).

    chat_template setting ─NAME─▶ FAMILIES[NAME] ─────────────────────────┐
                          ─PATH─▶ the file's Jinja2 ─────────────────────┤
    unset ─▶ GGUF header ─has tokenizer.chat_template─▶ None (the GGUF's) ┼─▶ EngineSpec.chat_template ─▶ the
                         ─has none─▶ ARCHITECTURES[general.architecture] ─┘   engine's ChatTemplate ─READY─▶
                                     (a hint, e.g. Ollama's template, first)   gateway (renders; tool parser)

The families follow llama.cpp's built-in templates (``llm_chat_apply_template``) and llama-cpp-python's chat
formats, as Hugging Face chat templates: ``messages`` with ``add_generation_prompt``, ``bos_token`` empty (the
engines add BOS). ``chatml`` is the gateway's own default prompt (``""``: no template, which also stops at
``<|im_end|>``). Tool calls in a conversation's history are written as the gateway's tools prompt asks for
them (``<tool_call>``, Hermes' format), and tools' answers as ``The tool returned: …`` asking for the answer, so a
family template and the ChatML default read tool calls the same way (``mpserve.families.for_template``); the
families whose models have a call format of their own (gpt-oss, Qwen3-Coder, GLM, Kimi, DeepSeek V3.1) write theirs
(``tool_families``). A system or
developer message goes where the family puts it: its own turn, or before the first user message (Gemma,
Mistral).
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

from mpserve.errors import ConfigError

from .tool_families import TOOL_FAMILIES

log = logging.getLogger("mpserve.templates")

def _lit(text: str) -> str:
    """``text`` as a Jinja2 expression: literal text next to tags would lose newlines to trim_blocks."""
    return "{{ " + json.dumps(text, ensure_ascii=False) + " }}"


# A message as every family writes it: content, then the assistant's tool calls, or a tool's answer.
_CONTENT = (
    "{% macro content(m) %}"
    "{% if m['role'] == 'tool' %}" + _lit("The tool returned: ") + "{{ m['content'] }}"  # the gateway's TOOL_RESULT
    + _lit("\nUsing this, answer my question.")
    + "{% else %}{{ m['content'] | trim }}"
    "{% for call in m.get('tool_calls', []) %}"
    "{% if not loop.first or m['content'] | trim %}" + _lit("\n") + "{% endif %}" + _lit("<tool_call>\n")
    + "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    + _lit("\n</tool_call>") + "{% endfor %}{% endif %}"
    "{% endmacro %}"
)
# The system text (system and developer messages, joined) and the conversation without them.
_SYSTEM = (
    "{% set system = messages | selectattr('role', 'in', ['system', 'developer']) | map(attribute='content')"
    " | join('\\n\\n') %}"
    "{% set turns = messages | rejectattr('role', 'in', ['system', 'developer']) | list %}"
)


def _turns(head: str, user: str, assistant: str, end: str, *, system_in_first: bool = False,
           assistant_end: str | None = None) -> str:
    """A template that writes ``head`` (Jinja2 that may use ``system``), then each turn after its role's
    opening (a tool's answer is a user turn) and before ``end`` (``assistant_end``, Jinja2, after a reply,
    if it differs), then the assistant's opening for the generation prompt. ``system_in_first``: the system text
    opens the first turn, for families without a system turn."""
    first = ("{% if loop.first and system %}{{ system }}" + _lit("\n\n") + "{% endif %}"
             if system_in_first else "")
    closing = _lit(end) if assistant_end is None else (
        "{% if m['role'] == 'assistant' %}" + assistant_end + "{% else %}" + _lit(end) + "{% endif %}")
    return (_CONTENT + _SYSTEM + head + "{% for m in turns %}"
            "{% if m['role'] == 'assistant' %}" + _lit(assistant) + "{% else %}" + _lit(user) + "{% endif %}"
            + first + "{{ content(m) }}" + closing
            + "{% endfor %}"
            "{% if add_generation_prompt %}" + _lit(assistant) + "{% endif %}")


def _system_turn(opening: str, end: str, default: str = "") -> str:
    """A head writing the system text as its own turn (``default`` when there is none)."""
    return ("{% if system %}" + _lit(opening) + "{{ system }}" + _lit(end)
            + ("{% else %}" + _lit(opening + default + end) if default else "") + "{% endif %}")


FAMILIES: dict[str, str] = {
    "chatml": "",
    "llama3": _turns(_system_turn("<|start_header_id|>system<|end_header_id|>\n\n", "<|eot_id|>"),
                     "<|start_header_id|>user<|end_header_id|>\n\n",
                     "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "gemma": _turns("", "<start_of_turn>user\n", "<start_of_turn>model\n", "<end_of_turn>\n",
                    system_in_first=True),
    "mistral": _turns("", "[INST] ", "", " [/INST]", system_in_first=True, assistant_end="{{ eos_token }}"),
    "phi": _turns(_system_turn("<|system|>\n", "<|end|>\n"), "<|user|>\n", "<|assistant|>\n", "<|end|>\n"),
    "qwen": _turns(_system_turn("<|im_start|>system\n", "<|im_end|>\n", "You are a helpful assistant."),
                   "<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>\n"),
    "qwen3": _turns(_system_turn("<|im_start|>system\n", "<|im_end|>\n"), "<|im_start|>user\n",
                    "<|im_start|>assistant\n", "<|im_end|>\n")
    + "{% if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
    + _lit("<think>\n\n</think>\n\n") + "{% endif %}",
    "deepseek": _turns("{{ system }}", "<｜User｜>", "<｜Assistant｜>", "",
                       assistant_end=_lit("<｜end▁of▁sentence｜>")),
    **TOOL_FAMILIES,
}
"""Each family's template by the name ``chat_template`` takes (``chatml``: the gateway's default). ``qwen3`` thinks
(Qwen 3's format): its reply opens with ``<think>``, which the gateway writes when the thinking is on
(``mpserve.gateway.api.reasoning``); ``enable_thinking`` false writes an empty thinking instead. ``gpt-oss``,
``qwen3-coder``, ``glm``, ``kimi`` and ``deepseek-v3`` write their tools and calls in their own formats
(``tool_families``)."""

ARCHITECTURES: dict[str, str] = {
    "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3n": "gemma", "gemma-embedding": "gemma",
    "qwen": "qwen", "qwen2": "qwen", "qwen2moe": "qwen", "qwen2vl": "qwen", "qwen3": "qwen3", "qwen3moe": "qwen3",
    "phi3": "phi", "phimoe": "phi",
    "deepseek": "deepseek", "deepseek2": "deepseek",
    "mistral3": "mistral",
    "gpt-oss": "gpt-oss", "glm4moe": "glm",
}
"""The family of a GGUF's ``general.architecture``, where one family uses it. ``llama`` is not here: Llama 2 and
3, Mistral and many fine-tunes share it, so a llama GGUF without a template gets ChatML, as in llama-server."""

_MARKERS: tuple[tuple[str, str], ...] = (
    ("<start_of_turn>", "gemma"), ("<|start_header_id|>", "llama3"), ("[INST]", "mistral"),
    ("<|assistant|>", "phi"), ("<｜Assistant｜>", "deepseek"), ("<|im_start|>", "chatml"),
)
"""A family recognised by a template written in another language (Ollama's Go templates)."""


def family_of_text(template: str) -> str | None:
    """The family whose turn markers ``template`` writes (any template language); None if none matches."""
    return next((family for marker, family in _MARKERS if marker in template), None)


def check_setting(value: str, where: str) -> str:
    """A ``chat_template`` value as given, once it names a family or a readable file (its text is read when
    the model's instances are built, ``template_for``)."""
    if value in FAMILIES:
        return value
    path = Path(value)
    if not path.is_file():
        raise ConfigError(f"{where}: {value!r} is neither a template family ({', '.join(FAMILIES)}) nor a file; "
                          "give a family's name or a Jinja2 chat template file")
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read the chat template file {value!r}: {exc}") from None
    _check_jinja(source, f"{where}: {value!r}")
    return value


def template_for(setting: str | None, gguf: str, hint: str = "") -> str | None:
    """The template ``gguf``'s instances are served with: the Jinja2 source, ``""`` for the ChatML default, or
    None for the GGUF's own. ``setting``: the model's ``chat_template``; ``hint``: another template for the
    model (Ollama's), to recognise its family by when the GGUF has none."""
    if setting in FAMILIES:
        return FAMILIES[setting]
    if setting is not None:
        return Path(setting).read_text(encoding="utf-8")
    return _fallback(gguf, hint)


@functools.lru_cache(maxsize=64)
def _fallback(gguf: str, hint: str) -> str | None:
    """None where the GGUF has a template; else its family's, said once per file (cached)."""
    from mpserve.models.gguf_header import read_header

    try:
        metadata = read_header(gguf, {"tokenizer.chat_template", "general.architecture"}.__contains__).metadata
    except ValueError:  # a header this reader cannot follow: the GGUF's own, as llama.cpp's loader reads it
        return None
    if metadata.get("tokenizer.chat_template"):
        return None
    architecture = str(metadata.get("general.architecture", "unknown"))
    family = family_of_text(hint) if hint else None
    why = "its Ollama template's turn markers" if family else f"its architecture, {architecture}"
    family = family or ARCHITECTURES.get(architecture)
    if family is None:
        log.info("%s has no chat template and its architecture (%s) is not one family's: using ChatML; set "
                 "chat_template to one of %s if the model was trained on another", gguf, architecture,
                 ", ".join(FAMILIES))
        return ""
    log.info("%s has no chat template: using the %s family's, chosen by %s (set chat_template to choose "
             "another)", gguf, family, why)
    return FAMILIES[family]


def _check_jinja(source: str, where: str) -> None:
    import jinja2
    import jinja2.sandbox

    try:
        jinja2.sandbox.ImmutableSandboxedEnvironment().parse(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{where} is not a Jinja2 chat template: line {exc.lineno}: {exc.message}") from None
