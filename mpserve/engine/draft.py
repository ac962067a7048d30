"""Speculative decoding with a draft model (``speculative: {type: draft, model: PATH}``): a second llama.cpp
context, on a model with the target's vocabulary, proposes the next tokens of each sequence that drafts;
the target verifies them in its next decode as it does prompt-lookup drafts (``mpserve.engine.speculation``).

    BatchEngine.step: the sequences that draft this step, and how many tokens each (Drafter.size)
      DraftModel.propose([Want(slot, tokens, n_prompt, k, key), ...])   tokens: prompt, generated, the one
                                                                        decoded now; key: its reuse key
        sync    per sequence: the common prefix of ``tokens`` and the tokens whose cells the draft holds
                for that slot (within the prompt, whole chunks of it), none when those cells were computed
                under another reuse key (``reuse_key``: tenant's salt, adapters); the cells after it removed
                (llama_memory_seq_rm; all of the slot's where the memory cannot cut there or no longer
                holds what the prefix needs); the rest of ``tokens`` decoded in the decodes the model
                computed them in: the prompt a chunk a decode, generated tokens at most ``exact_rows`` rows a
                decode, several sequences' together
        draft   a sequence's first draft: the argmax of its last token's row; while it wants more, its
                latest draft decoded at the next position (one decode for all the sequences that do) and
                the argmax of that row taken
      → k drafts per sequence; the slot's token list now says what its cells hold (``tokens``, then the
        drafts but the last)

One rule, "keep the common prefix, decode the rest", keeps the draft in step with the target without a
hook anywhere else: tokens the target took, drafts it rejected, a new request in the slot, a prefix copied
from another slot, cells restored from the host store or a slot file, tokens carried over from a lost
instance all come out as a prefix to keep and a tail to decode. The cells of rejected drafts therefore go
at the sequence's next sync, not right after verification.

The draft's cells belong to whoever computed them, as the slot's cells do (``mpserve.engine.cells``): a slot's
cells are kept only for a sequence of the same reuse key. Otherwise a tenant could time a guess at another
tenant's prompt by how fast its drafts came (a kept prefix skips the draft's prefill), even with the target's
cells unshared.

Output is unchanged: a greedy draft is a deterministic function of tokens the sequence already has, so
verification's acceptance rule (see ``mpserve.engine.speculation``) keeps the target's distribution
exactly, and with the same logits gives the same tokens, whatever the draft proposes. A draft model only
changes how many drafts are taken. Its own numbers still follow the model's decodes where they can (the
same prompt chunks, small decodes): a token computed in another batch shape gets slightly other numbers,
and a draft that is the model itself would then pick otherwise at near-ties.

Cost: ``draft_s`` is what one more draft adds to a step, the measured seconds of a drafting decode; until
one is measured, the target's one-row decode scaled by the size of the draft's weights against the
target's (a decode is bound by reading the weights). A draft that is the target's own file shares its
loaded weights: only its context and cells are extra.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from mpserve.wire.prefix import common_prefix

from .llama_batch import Batch
from .model_info import float_weights, free, load_model
from .speculation import ROW_COST_KEEP, exact_rows


class Want(NamedTuple):
    """A sequence that drafts this step: its slot, its tokens (prompt, generated, the last one the token the
    model decodes now), how many of them are its prompt's, how many drafts it wants (at least 1), and the key
    its cells are reused under (``reuse_key``)."""

    slot: int
    tokens: list[int]
    n_prompt: int
    k: int
    key: bytes


class DraftModel:
    """The draft model and its context: ``parallel`` sequences (one per slot) of ``n_ctx`` cells each."""

    def __init__(self, lib: Any, path: str, target_path: str, target_model: Any, params: Any,
                 n_gpu_layers: int, repack: bool, chunk: int) -> None:
        """``params``: the context's (the model's, with the same cells per sequence); ``chunk``: the tokens
        of a prompt chunk, which is also the most a decode of the draft holds."""
        self._lib = lib
        self._chunk = chunk
        self._own_model = os.path.realpath(path) != os.path.realpath(target_path)
        self._model: Any = load_model(lib, path, n_gpu_layers, repack) if self._own_model else target_model
        self._rows = exact_rows(repack and not float_weights(lib, self._model))
        self._ctx: Any = None
        try:
            self._check(path, target_path, target_model)
            params.n_batch = params.n_ubatch = chunk
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
        self._keys: list[bytes] = [b"" for _ in range(params.n_seq_max)]  # the reuse key they were computed under
        self._batch = Batch(lib, chunk)
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

    def propose(self, wants: Sequence[Want]) -> list[list[int]]:
        """``k`` greedy drafts to follow each sequence's ``tokens``."""
        drafts = self._catch_up(wants)
        for depth in range(1, max(want.k for want in wants)):  # one decode per draft position
            batch = self._batch
            batch.n = 0
            rows = [(i, batch.add(drafts[i][-1], len(want.tokens) + depth - 1, want.slot))
                    for i, want in enumerate(wants) if want.k > depth]
            self._decode(measured=True)
            for i, row in rows:
                drafts[i].append(self._argmax(row))
        for want, made in zip(wants, drafts, strict=True):
            self._held[want.slot] = [*want.tokens, *made[:-1]]
        return drafts

    def _catch_up(self, wants: Sequence[Want]) -> list[list[int]]:
        """Decode what each sequence's cells lack, in the decodes the model computed them in: prompt tokens
        a chunk a decode, from whole chunks (a token's numbers depend on how many rows its batch holds, and
        a draft that computes a token otherwise than the model may pick otherwise at a near-tie), generated
        ones at most ``exact_rows`` rows a decode (every row as alone); each sequence's first draft."""
        chunks: list[tuple[int, int, int]] = []  # (index in wants, start, end)
        tails: list[tuple[int, int, int]] = []
        for i, want in enumerate(wants):
            start = self._sync(want)
            while start < want.n_prompt:
                end = min(start - start % self._chunk + self._chunk, want.n_prompt)
                chunks.append((i, start, end))
                start = end
            for at in range(start, len(want.tokens), self._rows):
                tails.append((i, at, min(at + self._rows, len(want.tokens))))
        packed: list[list[tuple[int, int, int]]] = []  # the tails, several sequences' in a decode
        for tail in tails:
            if not packed or sum(end - begin for _, begin, end in packed[-1]) + tail[2] - tail[1] > self._rows:
                packed.append([])
            packed[-1].append(tail)
        drafts: list[list[int]] = [[] for _ in wants]
        for runs in [[chunk] for chunk in chunks] + packed:
            batch, rows = self._batch, []
            batch.n = 0
            for i, begin, end in runs:
                want = wants[i]
                last = batch.add_run(want.tokens[begin:end], begin, want.slot)
                if end == len(want.tokens):
                    batch.logits[last] = 1
                    rows.append((i, last))
            self._decode(measured=batch.n <= 2 * len(wants))
            for i, row in rows:
                drafts[i].append(self._argmax(row))
        return drafts

    def _sync(self, want: Want) -> int:
        """Keep the slot's cells of the longest prefix of the tokens they hold, cut to whole chunks within the
        prompt and never all of the tokens (the last one is decoded for its row), and none computed under
        another key; the position decoding starts at."""
        slot, tokens = want.slot, want.tokens
        held = self._held[slot] if self._keys[slot] == want.key else []
        self._keys[slot] = want.key
        keep = min(common_prefix(held, tokens), len(tokens) - 1)
        if keep < want.n_prompt:
            keep -= keep % self._chunk
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
        free(self._lib, self._ctx, self._model if self._own_model else None)
        self._ctx = self._model = None
