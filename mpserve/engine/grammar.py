"""Grammar samplers for constrained sequences: llama.cpp's own (``llama_sampler_init_grammar``), parsed
once per distinct GBNF text and cloned for each sequence.

    BatchEngine.admit ──GBNF text──▶ GrammarCache.sampler(text) ──▶ a Grammar: a clone and the step budget, which
                                        │                            that sequence's chain checks its draws with
                                        │ miss: ambiguity(text) over MAX_AMBIGUITY ──▶ GrammarTooComplex
                                        │       llama_sampler_init_grammar (parse), kept as a pristine copy
                                        │ NULL: llama.cpp could not parse it ──▶ BadRequest at admission

A pristine sampler is never added to a chain, so it never accepts a token: ``llama_sampler_clone`` of it
copies the parsed rules and the start state, which skips parsing the text again. llama.cpp prints why it
could not parse a grammar to the process's stderr and its log (``llama_log.reasons`` collects both): the
request gets BadRequest with that reason and the first line of the text. A grammar is measured before it is
parsed (``mpserve.engine.ambiguity``): one that would hold too many parse stacks at a step is refused by name,
since every step of the batch would wait on it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llama_cpp

from mpserve.errors import BadRequest, GrammarTooComplex

from .ambiguity import MAX_AMBIGUITY, ambiguity
from .llama_log import Said, reasons

CACHED_GRAMMARS = 32


@dataclass(frozen=True)
class Grammar:
    """A sequence's grammar sampler (its owner frees it) and the seconds one step may spend in it."""

    sampler: Any
    step_budget_s: float


class GrammarCache:
    """Parsed grammars of one model's vocabulary, least recently used dropped first; ``close`` frees them.
    ``step_budget_s``: what each sequence's grammar may spend on one step (``SamplerChain``)."""

    def __init__(self, vocab: Any, step_budget_s: float, size: int = CACHED_GRAMMARS) -> None:
        self._vocab = vocab
        self._budget = step_budget_s
        self._size = size
        self._parsed: OrderedDict[str, Any] = OrderedDict()

    def sampler(self, text: str) -> Grammar:
        """A fresh grammar sampler for ``text``, owned by the caller; GrammarTooComplex for an ambiguity past
        MAX_AMBIGUITY, BadRequest for a text llama.cpp cannot parse."""
        pristine = self._parsed.get(text)
        if pristine is None:
            if (measured := ambiguity(text)) > MAX_AMBIGUITY:
                raise GrammarTooComplex(f"the grammar opens more than {MAX_AMBIGUITY} alternatives that begin alike "
                                        f"at one point ({measured} or more parse stacks at one step); merge their "
                                        "common beginnings, or use fewer alternatives")
            with reasons() as said:
                pristine = llama_cpp.llama_sampler_init_grammar(self._vocab, text.encode(), b"root")
            if not pristine:
                first = text.strip().splitlines()[0] if text.strip() else ""
                raise BadRequest(f"'grammar' is not valid GBNF: {_reason(said)} (it begins {first[:80]!r})")
            self._parsed[text] = pristine
            while len(self._parsed) > self._size:
                llama_cpp.llama_sampler_free(self._parsed.popitem(last=False)[1])
        self._parsed.move_to_end(text)
        return Grammar(llama_cpp.llama_sampler_clone(pristine), self._budget)

    def __len__(self) -> int:
        return len(self._parsed)

    def close(self) -> None:
        for sampler in self._parsed.values():
            llama_cpp.llama_sampler_free(sampler)
        self._parsed.clear()


def _reason(said: Said) -> str:
    """llama.cpp's words for a grammar it could not parse: its parser's error, else its log's error lines."""
    parsed = [line.split("error parsing grammar: ", 1)[1] for line in said.printed if "error parsing grammar: " in line]
    found = parsed or [line for line in said.errors if line != "failed to parse grammar"]
    return f"llama.cpp says {'; '.join(found)!r}" if found else "llama.cpp could not parse it (it gave no reason)"
