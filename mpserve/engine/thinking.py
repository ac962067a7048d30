"""Thinking: a phase of a sequence's decoding, for a reply whose prompt opened its thinking (``<think>``).

    admit ──params.reasoning_end──▶ sampler_for ──▶ Phases(free chain, answer chain, the closing tokens, the budget):
        the sequence's sampler (``Sequence.sampler``); the batch samples and replays through it as through one chain
    THINK   the free chain (the request's sampling, no grammar); every token counted against the budget
            ├─ the model writes the end tag (its text, however tokenized) ─────────────────────────────▶ ANSWER
            └─ the budget spent: the closing tokens (the model's close message, then the end tag), given
               one a step in place of sampling ────────────────────────────────────────────────────────▶ ANSWER
    ANSWER  the answer chain: the request's grammar (GBNF, a JSON schema, a forced tool call) from its first token

The chain changes between the phases, so a grammar never sees the thinking and the thinking is never held to it.
The closing tokens count as thinking: a reply's thinking takes at most its budget and the closing tokens. Their
text goes out like any other, so the end tag is in the completion's text where the phase changed; the gateway
splits the text there (``mpserve.gateway.api.reasoning``). Tokens taken instead of sampled (carried over from a
lost instance, ``accept``) move the phases as sampled ones do, so a resumed reply goes on in its phase.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import llama_cpp

from mpserve.config.reasoning import Reasoning
from mpserve.errors import BadRequest, GrammarTooComplex
from mpserve.wire.protocol import GenerateParams

from .grammar import Grammar
from .sampling import SamplerChain

if TYPE_CHECKING:
    from .context import Context


class Phases:
    """A thinking sequence's sampler: the free chain while it thinks, the answer chain from its end tag on."""

    def __init__(self, free: SamplerChain, answer: SamplerChain, closing: Sequence[int], end: bytes, budget: int,
                 piece: Callable[[int], bytes]) -> None:
        """``closing``: the tokens the budget forces, ending with the end tag, whose text is ``end``; ``piece``: a
        token's bytes; ``budget``: -1 for none."""
        self._free, self._answer = free, answer
        self._closing, self._end, self._budget, self._piece = tuple(closing), end, budget, piece
        self._tail = b""  # the thinking's last bytes, where the end tag is looked for
        self.thinking = True
        self.spent = 0  # tokens of thinking so far, the closing ones included

    @property
    def refused(self) -> GrammarTooComplex | None:
        return self._answer.refused

    def sample(self, ctx: Any, output_index: int) -> int:
        """The next token: sampled in the phase's chain, or the next closing token once the budget is spent."""
        if not self.thinking:
            return self._answer.sample(ctx, output_index)
        forcing = self._budget >= 0 and self.spent >= self._budget
        token = self._closing[self.spent - self._budget] if forcing else self._free.sample(ctx, output_index)
        self._count(token)
        return token

    def accept(self, tokens: list[int]) -> None:
        """Tokens taken instead of sampled: counted in the phase they fall in."""
        for token in tokens:
            if self.thinking:
                self._free.accept([token])
                self._count(token)
            else:
                self._answer.accept([token])

    def _count(self, token: int) -> None:
        self.spent += 1
        self._tail = (self._tail + self._piece(token))[-2 * len(self._end):]
        forced_all = self._budget >= 0 and self.spent - self._budget >= len(self._closing)
        if self._end in self._tail or forced_all:
            self.thinking = False

    def close(self) -> None:
        self._free.close()
        self._answer.close()


def closing_tokens(tokenize: Callable[[str], list[int]], piece: Callable[[int], bytes], text: str) -> list[int]:
    """``text``'s tokens as generated ones: without the space a tokenizer that adds one before a text's first word
    (SentencePiece's) puts first, when the pieces spell it that way."""
    tokens = tokenize(text)
    if tokens and not text.startswith(" ") and piece(tokens[0]) == b" " and \
            b"".join(map(piece, tokens[1:])) == text.encode():
        return tokens[1:]
    return tokens


def sampler_for(context: Context, params: GenerateParams, seed: int, grammar: Grammar | None, reasoning: Reasoning,
                n_ctx: int) -> SamplerChain | Phases:
    """A sequence's sampler: one chain (with ``grammar``, owned from here), or a thinking reply's ``Phases``, under
    the request's budget, else its effort's (at most ``n_ctx``). BadRequest for a request's budget past ``n_ctx``
    (``grammar`` freed)."""
    eog = context.eog_tokens() if params.ignore_eos else ()
    if params.reasoning_end is None:
        return SamplerChain(context.n_vocab, params, seed, eog, grammar)
    budget = params.reasoning_budget
    if budget is None:
        budget = min(reasoning.budget(params.reasoning_effort), n_ctx)
    elif budget > n_ctx:
        if grammar is not None:
            llama_cpp.llama_sampler_free(grammar.sampler)
        raise BadRequest(f"'reasoning_budget' = {budget} is more than the context holds ({n_ctx} tokens a sequence; "
                         "Messages' thinking.budget_tokens); give at most that")
    closing = closing_tokens(lambda text: context.tokenize(text, False), context.piece_bytes,
                             f"{reasoning.close}\n{params.reasoning_end}")
    return Phases(SamplerChain(context.n_vocab, params, seed, eog), SamplerChain(context.n_vocab, params, seed, eog,
                                                                                  grammar),
                  closing, params.reasoning_end.encode(), budget, context.piece_bytes)
