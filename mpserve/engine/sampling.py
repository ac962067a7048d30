"""Per-sequence sampling and text for the batched engine (``mpserve.engine.batch``).

Two pieces, one of each per running sequence:

- ``SamplerChain``: the llama.cpp sampler chain that ``llama_cpp.Llama.create_completion`` builds for
  the same parameters (``Llama._init_sampler``), so a sequence sampled in a batch draws the same tokens
  as the same request sent to ``create_completion``: the logit bias (where create_completion puts its
  logit-bias processor: first), repetition, frequency and presence penalties over the last 64 sampled
  tokens, then greedy at temperature 0, else top-k, typical, top-p, min-p, temperature and a seeded draw.
  ``ignore_eos`` biases every end-of-generation token by minus infinity, as llama-server does. The chain
  owns its random state, so a seeded sequence does not depend on what else is in the batch. A constrained
  sequence (a grammar or a JSON Schema) gets a grammar sampler first in its chain (``mpserve.engine.grammar``):
  it rules out every token the grammar does not allow at this point, so constrained and unconstrained
  sequences share one batch.
  Greedy with nothing that changes the logits (no penalty, bias or grammar) needs no chain: the token is
  the first largest logit, which is what the chain's greedy sampler picks, read straight from the logits
  row instead of copying the whole vocabulary into a candidate array first.
- ``TextStream``: token bytes in, text out. It decodes UTF-8 incrementally (a character split over two
  tokens comes out whole, with the second), finds stop strings, and holds back any tail that may be the
  start of a stop string, so text handed to a client never has to be taken back.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Sequence
from typing import Any

import llama_cpp
import numpy as np

from mpserve.wire.protocol import GenerateParams

# llama_cpp.Llama's defaults for what GenerateParams does not carry; create_completion uses them too.
PENALTY_LAST_N = 64
MIN_KEEP = 1


class SamplerChain:
    """A native llama.cpp sampler chain for one sequence; ``close`` frees it."""

    def __init__(self, n_vocab: int, params: GenerateParams, seed: int, eog_tokens: Sequence[int] = (),
                 grammar: Any = None) -> None:
        """``eog_tokens``: the vocabulary's end-of-generation tokens, which ``params.ignore_eos`` bans;
        ``grammar``: the sequence's grammar sampler (a GrammarCache clone), or None."""
        self._n_vocab = n_vocab
        self._argmax = (params.temperature == 0.0 and params.repeat_penalty == 1.0 and not params.frequency_penalty
                        and not params.presence_penalty and not params.logit_bias and not params.ignore_eos
                        and grammar is None)  # the chain would change nothing
        self._chain: Any = None
        if self._argmax:
            return
        chain_params = llama_cpp.llama_sampler_chain_default_params()
        chain_params.no_perf = True
        self._chain = llama_cpp.llama_sampler_chain_init(chain_params)
        add = self._add
        # --- structured output: the sequence's grammar sampler (a GrammarCache clone), first in the chain
        if grammar is not None:
            add(grammar)
        # --- logit bias and OpenAI's penalties
        biases = list(params.logit_bias)
        if params.ignore_eos:
            biases += [(token, -math.inf) for token in eog_tokens]
        if biases:
            add(_logit_bias(n_vocab, biases))
        add(llama_cpp.llama_sampler_init_penalties(n_vocab, PENALTY_LAST_N, params.repeat_penalty,
                                                   params.frequency_penalty, params.presence_penalty))
        # ---
        if params.temperature == 0.0:
            add(llama_cpp.llama_sampler_init_greedy())
        else:
            add(llama_cpp.llama_sampler_init_top_k(params.top_k))
            add(llama_cpp.llama_sampler_init_typical(params.typical_p, MIN_KEEP))
            add(llama_cpp.llama_sampler_init_top_p(params.top_p, MIN_KEEP))
            add(llama_cpp.llama_sampler_init_min_p(params.min_p, MIN_KEEP))
            add(llama_cpp.llama_sampler_init_temp(params.temperature))
            add(llama_cpp.llama_sampler_init_dist(seed))

    def _add(self, sampler: Any) -> None:
        llama_cpp.llama_sampler_chain_add(self._chain, sampler)  # the chain owns it from here

    def sample(self, ctx: Any, output_index: int) -> int:
        """Sample from the logits of batch row ``output_index`` of the last decode, and record the token
        (the penalties and the random state advance)."""
        if self._argmax:
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, output_index), (self._n_vocab,))
            return int(np.argmax(row))
        token: int = llama_cpp.llama_sampler_sample(self._chain, ctx, output_index)
        return token

    # --- resuming a sequence another instance started -------------------------------------------------

    def accept(self, tokens: list[int]) -> None:
        """Record tokens sampled before (elsewhere), so the penalties see them as this chain's own."""
        for token in tokens:
            llama_cpp.llama_sampler_accept(self._chain, token)

    def close(self) -> None:
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None


def _logit_bias(n_vocab: int, biases: list[tuple[int, float]]) -> Any:
    """llama.cpp's logit-bias sampler: ``bias`` added to the logit of each ``token`` (ids below ``n_vocab``)."""
    entries = (llama_cpp.llama_logit_bias * len(biases))(*(llama_cpp.llama_logit_bias(t, b) for t, b in biases))
    return llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(biases), entries)  # it copies the entries


class TextStream:
    """Turns the byte pieces of generated tokens into text that is safe to hand out.

    ``push`` returns the text that can be released now and whether a stop string was found; on a stop,
    the text is cut just before the earliest stop string and the stream is done. ``flush`` releases
    what is held back (the end of a completion that stopped for another reason).

    ``strip_leading_space``: drop one leading space from the completion, as llama-cpp-python's
    detokenizer does when the prompt is empty (the completion then follows BOS directly).
    """

    __slots__ = ("_decoder", "_stops", "_longest_stop", "_held", "_strip")

    def __init__(self, stops: tuple[str, ...], strip_leading_space: bool = False) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        self._stops = stops
        self._longest_stop = max((len(s) for s in stops), default=0)
        self._held = ""
        self._strip = strip_leading_space

    def push(self, piece: bytes) -> tuple[str, bool]:
        if self._strip and piece:
            self._strip = False
            if piece[:1] == b" ":
                piece = piece[1:]
        text = self._decoder.decode(piece)
        if not self._stops:
            return text, False
        held = self._held + text
        cut = min((i for i in (held.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return held[:cut], True
        keep = self._stop_prefix_length(held)
        self._held = held[len(held) - keep:] if keep else ""
        return held[:len(held) - keep], False

    def flush(self) -> str:
        rest = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return rest

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is the start of some stop string."""
        for n in range(min(len(text), self._longest_stop - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
