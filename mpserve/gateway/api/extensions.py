"""llama-server's request extensions on ``/v1/completions`` and ``/v1/chat/completions``: mapped to OpenAI's
names where mpserve has the setting, dropped where it does not apply. No I/O here.

    body ──translate──▶ (the body in OpenAI's and mpserve's names, the extensions dropped)
        n_predict ──▶ max_tokens (-1, llama-server's "until the end", leaves it to mpserve's default)
        n_probs   ──▶ logprobs N (completions), logprobs true and top_logprobs N (chat)
        lora      ──▶ kept: the LoRA adapters to apply (``openai.Call.lora``, resolved by ``adapters``)
        chat_template_kwargs, reasoning_format ──▶ kept by a chat: its template's variables, its thinking
                                                   (``reasoning``); dropped by a completion
        IGNORED   ──▶ dropped; the response says which in its ``X-Mpserve-Ignored`` header

llama-server's names that are mpserve's too (top_k, min_p, typical_p, repeat_penalty, ignore_eos, seed,
grammar, json_schema, logit_bias as pairs) need no mapping. A key that neither OpenAI nor llama-server has
is still refused by ``openai.parse``.
"""

from __future__ import annotations

from typing import Any

from mpserve.errors import BadRequest

HEADER = "X-Mpserve-Ignored"
IGNORED = frozenset({
    "cache_prompt",  # mpserve reuses cached prompt prefixes by itself
    "id_slot",  # the broker places each request in a free slot
    "samplers",  # mpserve's sampler chain has one order
    "n_keep", "n_discard",  # a prompt over the context is refused, not shifted
    "n_indent", "n_cmpl", "t_max_predict_ms", "t_max_prompt_ms", "timings_per_token", "return_tokens",
    "return_progress", "post_sampling_probs", "response_fields", "min_keep", "repeat_last_n", "penalize_nl",
    "mirostat", "mirostat_tau", "mirostat_eta", "dynatemp_range", "dynatemp_exponent", "xtc_probability",
    "xtc_threshold", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
    "dry_sequence_breakers", "top_n_sigma", "chat_template_kwargs", "reasoning_format", "parse_tool_calls",
    "thinking_forced_open", "add_generation_prompt",
})
"""llama-server's request fields that mpserve accepts and does not apply."""
MAPPED = ("n_predict", "n_probs")
FIELDS = IGNORED | frozenset(MAPPED)
"""Every llama-server field taken here (the OpenAPI document lists each)."""
CHAT_TAKES = frozenset({"chat_template_kwargs", "reasoning_format"})
"""Of those, the ones a chat applies (``reasoning``: its template's variables, how its thinking is returned)."""


def translate(chat: bool, body: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``body`` with llama-server's extensions mapped or dropped, and the names of those dropped."""
    dropped = IGNORED - CHAT_TAKES if chat else IGNORED
    ignored = tuple(sorted(k for k in body if k in dropped))
    out = {k: v for k, v in body.items() if k not in dropped}
    n_predict = out.pop("n_predict", None)
    if n_predict is not None:
        if out.get("max_tokens") is not None or out.get("max_completion_tokens") is not None:
            raise BadRequest("give 'max_tokens' or llama-server's 'n_predict', not both")
        if n_predict != -1:
            out["max_tokens"] = n_predict
    n_probs = out.pop("n_probs", None)
    if n_probs is not None and n_probs != 0:
        if out.get("logprobs") not in (None, False) or out.get("top_logprobs") is not None:
            raise BadRequest("give 'logprobs' or llama-server's 'n_probs', not both")
        if chat:
            out["logprobs"], out["top_logprobs"] = True, n_probs
        else:
            out["logprobs"] = n_probs
    return out, ignored
