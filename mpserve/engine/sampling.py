"""Per-sequence sampling and text for the batched engine (``mpserve.engine.batch``).

Two pieces, one of each per running sequence:

- ``SamplerChain``: the llama.cpp sampler chain that ``llama_cpp.Llama.create_completion`` builds for
  the same parameters (``Llama._init_sampler``), so a sequence sampled in a batch draws the same tokens
  as the same request sent to ``create_completion``: the logit bias (where create_completion puts its
  logit-bias processor: first), repetition, frequency and presence penalties over the last 64 sampled
  tokens, then greedy at temperature 0, else top-k, typical, top-p, min-p, temperature and a seeded draw.
  ``ignore_eos`` biases every end-of-generation token by minus infinity, as llama-server does. The chain
  owns its random state, so a seeded sequence does not depend on what else is in the batch. A constrained
  sequence (a grammar or a JSON Schema) has a grammar sampler beside its chain (``mpserve.engine.grammar``),
  driven as llama.cpp's own ``common_sampler_sample`` drives it (sample, then check): the chain draws from
  every token, the grammar checks the one drawn, and only where it rules that one out does it rule out every
  token it does not allow, and the chain draws again; the token is then accepted by both. Greedy, this is the
  token the grammar first in the chain would give; and constrained and unconstrained sequences share one batch.
  A grammar's work on one step (the check, the whole vocabulary where the check failed, the accept) has a
  budget of processor time (what the step cost, whatever else the host runs): past it, the sequence ends with
  GrammarTooComplex (``refused``), and the others in the batch go on.
  Greedy with nothing that changes the logits (no penalty, bias or grammar) needs no chain: the token is
  the first largest logit, which is what the chain's greedy sampler picks, read straight from the logits
  row instead of copying the whole vocabulary into a candidate array first.
- ``TextStream``: token bytes in, text out. It decodes UTF-8 incrementally (a character split over two
  tokens comes out whole, with the second), finds stop strings, and holds back any tail that may be the
  start of a stop string, so text handed to a client never has to be taken back.
"""

from __future__ import annotations

import codecs
import ctypes
import math
import time
from collections.abc import Sequence
from typing import Any

import llama_cpp
import numpy as np

from mpserve.errors import GrammarTooComplex
from mpserve.wire.protocol import GenerateParams

from .grammar import Grammar

# llama_cpp.Llama's defaults for what GenerateParams does not carry; create_completion uses them too.
PENALTY_LAST_N = 64
MIN_KEEP = 1
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])  # llama_token_data's layout


class SamplerChain:
    """A native llama.cpp sampler chain for one sequence; ``close`` frees it."""

    def __init__(self, n_vocab: int, params: GenerateParams, seed: int, eog_tokens: Sequence[int] = (),
                 grammar: Grammar | None = None) -> None:
        """``eog_tokens``: the vocabulary's end-of-generation tokens, which ``params.ignore_eos`` bans;
        ``grammar``: the sequence's grammar (a GrammarCache clone, owned from here), or None."""
        self._n_vocab = n_vocab
        self._argmax = (params.temperature == 0.0 and params.repeat_penalty == 1.0 and not params.frequency_penalty
                        and not params.presence_penalty and not params.logit_bias and not params.ignore_eos
                        and grammar is None)  # the chain would change nothing
        self._chain: Any = None
        self._grammar = grammar
        self.refused: GrammarTooComplex | None = None  # why the last ``sample`` gave -1
        if self._argmax:
            return
        chain_params = llama_cpp.llama_sampler_chain_default_params()
        chain_params.no_perf = True
        self._chain = llama_cpp.llama_sampler_chain_init(chain_params)
        add = self._add
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
        if self._grammar is not None:
            return self._constrained(ctx, output_index, self._grammar)
        token: int = llama_cpp.llama_sampler_sample(self._chain, ctx, output_index)
        return token

    def _constrained(self, ctx: Any, output_index: int, grammar: Grammar) -> int:
        """Sample, then check (``common_sampler_sample``); -1, with ``refused`` set, where the grammar's part of the
        step (the processor time its calls took) ran past its budget."""
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, output_index), (self._n_vocab,))
        candidates = _Candidates(logits)
        llama_cpp.llama_sampler_apply(self._chain, candidates.array)
        token = candidates.selected()
        checked = (llama_cpp.llama_token_data * 1)(llama_cpp.llama_token_data(token, 1.0, 0.0))
        spent = _timed(grammar.sampler, _array(ctypes.addressof(checked), 1))
        if math.isinf(checked[0].logit):  # ruled out: the grammar rules out all it does not allow, and a new draw
            candidates = _Candidates(logits)
            spent += _timed(grammar.sampler, candidates.array)
            llama_cpp.llama_sampler_apply(self._chain, candidates.array)
            token = candidates.selected()
        spent += _timed(grammar.sampler, None, token)
        llama_cpp.llama_sampler_accept(self._chain, token)
        if spent > grammar.step_budget_s:
            self.refused = GrammarTooComplex(f"a sampling step under the request's grammar took {spent:.3f} s of "
                                             f"processor time, past its budget of {grammar.step_budget_s} s; the "
                                             "request ends here")
            return -1
        return token

    # --- resuming a sequence another instance started -------------------------------------------------

    def accept(self, tokens: list[int]) -> None:
        """Record tokens sampled before (elsewhere), so the penalties see them as this chain's own."""
        for token in tokens:
            if self._grammar is not None:
                llama_cpp.llama_sampler_accept(self._grammar.sampler, token)
            llama_cpp.llama_sampler_accept(self._chain, token)

    def close(self) -> None:
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
        if self._grammar is not None:
            llama_cpp.llama_sampler_free(self._grammar.sampler)
            self._grammar = None


class _Candidates:
    """Every token of a logits row as a llama_token_data_array (``array``), for samplers to narrow in place."""

    def __init__(self, logits: np.ndarray) -> None:
        self.data = np.empty(len(logits), TOKEN_DATA)
        self.data["id"] = np.arange(len(logits), dtype=np.int32)
        self.data["logit"], self.data["p"] = logits, 0.0
        self.array = _array(self.data.ctypes.data, len(logits))

    def selected(self) -> int:
        """The token the last sampler of a chain chose."""
        return int(self.data["id"][self.array.contents.selected])


def _timed(sampler: Any, candidates: Any, token: int = -1) -> float:
    """Processor time of this thread spent by ``sampler`` on ``candidates`` (None: accepting ``token``)."""
    started = time.thread_time()
    if candidates is None:
        llama_cpp.llama_sampler_accept(sampler, token)
    else:
        llama_cpp.llama_sampler_apply(sampler, candidates)
    return time.thread_time() - started


def _array(address: int, size: int) -> Any:
    """A pointer to a llama_token_data_array over ``size`` entries at ``address``, none selected, not sorted."""
    data = ctypes.cast(address, ctypes.POINTER(llama_cpp.llama_token_data))
    return ctypes.pointer(llama_cpp.llama_token_data_array(data, size, -1, False))


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
