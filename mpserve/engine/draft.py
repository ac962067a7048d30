"""Speculative decoding with a draft model (``speculative: {type: draft, model: PATH}``): a second llama.cpp
context, on a model with the target's vocabulary, proposes the next tokens of each sequence that drafts;
the target verifies them in its next decode as it does prompt-lookup drafts (``mpserve.engine.speculation``).

    BatchEngine.step: the sequences that draft this step, and how many tokens each (Drafter.size)
      DraftModel.propose([(slot, tokens, k), ...])      tokens: prompt, generated, the one decoded now
        sync    per sequence: the common prefix of ``tokens`` and the tokens whose cells the draft holds
                for that slot; the cells after it removed (llama_memory_seq_rm; all of the slot's where
                the memory cannot cut there or no longer holds what the prefix needs), the rest of
                ``tokens`` decoded, every sequence's in the same decodes (at most PROMPT_CHUNK rows each)
        draft   a sequence's first draft: the argmax of its last token's row; while it wants more, its
                latest draft decoded at the next position (one decode for all the sequences that do) and
                the argmax of that row taken
      → k drafts per sequence; the slot's token list now says what its cells hold (``tokens``, then the
        drafts but the last)

One rule, "keep the common prefix, decode the rest", keeps the draft in step with the target without a
hook anywhere else: tokens the target took, drafts it rejected, a new request in the slot, a prefix copied
from another slot, cells restored from the prompt cache or a slot file, tokens carried over from a lost
instance all come out as a prefix to keep and a tail to decode. The cells of rejected drafts therefore go
at the sequence's next sync, not right after verification.

Output is unchanged: a greedy draft is a deterministic function of tokens the sequence already has, so
verification's acceptance rule (see ``mpserve.engine.speculation``) keeps the target's distribution
exactly, and with the same logits gives the same tokens, whatever the draft proposes. A draft model only
changes how many drafts are taken, so its own logits need no exactness: its decodes mix catch-up and
drafting rows freely.

Cost: ``draft_s`` is what one more draft adds to a step, the measured seconds of a drafting decode; until
one is measured, the target's one-row decode scaled by the size of the draft's weights against the
target's (a decode is bound by reading the weights). A draft that is the target's own file shares its
loaded weights: only its context and cells are extra.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from mpserve.prefix import common_prefix

from .llama_batch import Batch
from .model_info import load_model
from .speculation import ROW_COST_KEEP

CHUNK = 512
"""Most rows in one of the draft's decodes (its n_batch), as the target's prompt chunks."""


class DraftModel:
    """The draft model and its context: ``parallel`` sequences (one per slot) of ``n_ctx`` cells each."""

    def __init__(self, lib: Any, path: str, target_path: str, target_model: Any, params: Any,
                 n_gpu_layers: int, repack: bool) -> None:
        self._lib = lib
        self._own_model = os.path.realpath(path) != os.path.realpath(target_path)
        self._model: Any = load_model(lib, path, n_gpu_layers, repack) if self._own_model else target_model
        self._ctx: Any = None
        try:
            self._check(path, target_path, target_model)
            params.n_batch = params.n_ubatch = CHUNK
            self._ctx = lib.llama_init_from_model(self._model, params)
            if not self._ctx:
                raise ValueError(f"cannot create a llama.cpp context for the draft model {path} (the log has "
                                 "llama.cpp's reason)")
        except BaseException:
            self.close()
            raise
        self._memory = lib.llama_get_memory(self._ctx)
        self._n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model))
        self._n_swa = max(1, lib.llama_model_n_swa(self._model))
        self._size_ratio = lib.llama_model_size(self._model) / max(1, lib.llama_model_size(target_model))
        self._held: list[list[int]] = [[] for _ in range(params.n_seq_max)]  # tokens with cells, per slot
        self._batch = Batch(lib, CHUNK)
        self._draft_s: float | None = None  # seconds of a drafting decode (moving average)
        self._batch.add(0, 0, 0)  # llama.cpp sets up its graphs on the first decode: not in the first step
        self._decode(measured=False)
        lib.llama_memory_seq_rm(self._memory, 0, -1, -1)

    def _check(self, path: str, target_path: str, target_model: Any) -> None:
        """ValueError unless the draft can propose the target's tokens and drop its own cells."""
        lib = self._lib
        ours = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model))
        theirs = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(target_model))
        if ours != theirs:
            raise ValueError(f"the draft model {path} has {ours} tokens, the model {target_path} {theirs}: a draft "
                             "model needs the model's vocabulary")
        if lib.llama_model_is_recurrent(self._model) or lib.llama_model_is_hybrid(self._model):
            raise ValueError(f"the draft model {path} has recurrent layers, whose state cannot drop rejected "
                             "drafts; give a transformer draft model")

    def draft_s(self, target_one_row_s: float) -> float:
        """What one more draft costs a step, in the units of ``target_one_row_s`` until measured."""
        return self._draft_s if self._draft_s is not None else self._size_ratio * target_one_row_s

    def propose(self, wants: Sequence[tuple[int, Sequence[int], int]]) -> list[list[int]]:
        """``k`` greedy drafts to follow each ``(slot, tokens, k)``: ``tokens`` are the sequence's, the last
        one the token the target decodes now (``k`` >= 1)."""
        drafts: list[list[int]] = [[] for _ in wants]
        pending = [(i, slot, tokens, self._sync(slot, tokens)) for i, (slot, tokens, _) in enumerate(wants)]
        while pending:  # the missing tokens, CHUNK rows a decode; a sequence's first draft from its last row
            batch, rows = self._batch, []
            batch.n = 0
            left = []
            for i, slot, tokens, start in pending:
                n = min(CHUNK - batch.n, len(tokens) - start)
                if n == 0:
                    left.append((i, slot, tokens, start))
                    continue
                last = batch.add_run(list(tokens[start:start + n]), start, slot)
                if start + n == len(tokens):
                    batch.logits[last] = 1
                    rows.append((i, last))
                else:
                    left.append((i, slot, tokens, start + n))
            self._decode(measured=batch.n <= 2 * len(wants))
            for i, row in rows:
                drafts[i].append(self._argmax(row))
            pending = left
        for depth in range(1, max(k for _, _, k in wants)):  # one decode per draft position
            batch = self._batch
            batch.n = 0
            rows = [(i, batch.add(drafts[i][-1], len(tokens) + depth - 1, slot))
                    for i, (slot, tokens, k) in enumerate(wants) if k > depth]
            self._decode(measured=True)
            for i, row in rows:
                drafts[i].append(self._argmax(row))
        for (slot, tokens, _), made in zip(wants, drafts, strict=True):
            self._held[slot] = [*tokens, *made[:-1]]
        return drafts

    def _sync(self, slot: int, tokens: Sequence[int]) -> int:
        """Keep the slot's cells of the longest prefix of ``tokens`` they hold (never all of ``tokens``: the
        last one is decoded for its row); the position decoding starts at."""
        held = self._held[slot]
        keep = min(common_prefix(held, list(tokens)), len(tokens) - 1)
        lib, memory = self._lib, self._memory
        pos_min = lib.llama_memory_seq_pos_min(memory, slot)
        if keep == 0 or not lib.llama_memory_seq_rm(memory, slot, keep, -1) or not (
                0 <= pos_min <= max(0, keep - self._n_swa)):
            lib.llama_memory_seq_rm(memory, slot, -1, -1)  # whole-sequence removal never fails
            keep = 0
        self._held[slot] = held[:keep]
        return keep

    def _decode(self, measured: bool) -> None:
        started = time.perf_counter()
        rc = self._lib.llama_decode(self._ctx, self._batch.view())
        seconds = time.perf_counter() - started
        if rc != 0:
            raise RuntimeError(f"llama_decode of the draft model failed with status {rc}")
        if measured:
            old = self._draft_s
            self._draft_s = seconds if old is None else ROW_COST_KEEP * old + (1 - ROW_COST_KEEP) * seconds

    def _argmax(self, row: int) -> int:
        logits = np.ctypeslib.as_array(self._lib.llama_get_logits_ith(self._ctx, row), (self._n_vocab,))
        return int(np.argmax(logits))

    def close(self) -> None:
        """Free the context, and the model unless it is the target's."""
        if self._ctx:
            self._lib.llama_free(self._ctx)
            self._ctx = None
        if self._own_model and self._model:
            self._lib.llama_model_free(self._model)
        self._model = None
