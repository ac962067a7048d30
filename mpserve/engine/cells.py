"""What each slot's KV cells hold, and how a prompt gets the most of them: its own slot's, another slot's copied,
or (by ``keeping``) the host store's restored.

    best_slot(free, tokens, salt) ──▶ the free slot sharing the longest prefix (ties: least recently used)
    admit ──take_cells(slot, tokens, salt)──▶ cut the slot after the prefix it holds ──▶ reused (0: memory cannot
          cut, or its cells are another salt's) ──start(slot, tokens, reused, text, salt)──▶ cached / texts / whole
          / salts, per slot
    step  ──catch_up(prefilling)──▶ a prompt copies another slot's longer prefix (copy_source, copy_prefix), where
                                    that costs less than computing it (``copy_cost``: a stream is copied whole)
          ──share(lead, twins)───▶ prompts equal to one just computed take all its cells
    finish ──finished(seq)──▶ the slot keeps its cells for the next prompt that starts the same

Per slot: ``cached`` (tokens with cells, when no sequence runs there), ``texts`` (the text prompt they begin with),
``whole`` (the leading ones computed as whole prompt chunks, what ``reuse: exact`` may start from), ``salts`` (the
reuse namespace they were computed under, ``mpserve.wire.salt``: a prompt reuses, copies or shares the cells of its
own salt only, so nothing computed for one tenant is reused for another; a sequence under LoRA adapters has a salt
of its own for them, ``BatchEngine.admit``), ``spaces`` (the adapters they were computed under, ``Sequence.space``:
``keeping`` stores none of them, nor does a slot file). The rules of
what may be reused (``reusable``) and what the memory still holds (``holds_cells``) are here too. The KV memory is
reached through ``Memory`` only: the unit tests drive this with a fake.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

from mpserve.errors import Busy
from mpserve.wire.prefix import common_prefix

from .copy_cost import FREE, CopyCost
from .sequence import Sequence, usable, whole_cells, whole_chunks

if TYPE_CHECKING:
    from .media import Image

log = logging.getLogger("mpserve.worker")


class Memory(Protocol):
    """The KV memory operations the bookkeeping needs (``mpserve.engine.context.Context`` has them)."""

    def seq_rm(self, slot: int, p0: int, p1: int) -> bool: ...

    def seq_cp(self, source: int, slot: int, p0: int, p1: int) -> None: ...

    def seq_pos_min(self, slot: int) -> int: ...


class Cells:
    def __init__(self, memory: Memory, parallel: int, running: Mapping[int, Sequence], *, exact: bool,
                 kv_unified: bool, n_swa: int, has_store: bool) -> None:
        """``running``: the sequences by slot (the scheduler's, read here); ``n_swa``: the cells a sliding window
        keeps (1 without one); ``has_store``: whether a host store restores what a slot cannot keep."""
        self._memory, self.parallel, self._running = memory, parallel, running
        self._exact, self._kv_unified, self._n_swa, self._has_store = exact, kv_unified, n_swa, has_store
        self.cached: list[list[int]] = [[] for _ in range(parallel)]  # tokens with KV cells, per slot
        self.texts = [""] * parallel  # the text prompt those tokens begin with ("": token ids, or unknown), as
        # routing reads it: each image by its key (``wire.prefix.routed``)
        self.images: list[Mapping[int, Image]] = [{} for _ in range(parallel)]  # that prompt's images, by start
        self.whole = [0] * parallel  # of those, the leading ones computed (or copied) as whole prompt chunks
        self.salts = [b""] * parallel  # the salt its cells were computed under (its running sequence's)
        self.spaces = [b""] * parallel  # the adapters they were computed under (``Sequence.space``; b"": none)
        self._last_used = [0] * parallel
        self._uses = 0
        self._told_cells_missing = False
        self.reused = self.copies = 0  # counters: prompt tokens reused, admissions that copied another slot's cells
        self.copy_cost: CopyCost = FREE  # measured by the engine where a copy moves a whole stream (``copy_cost``)

    def best_slot(self, free: list[int], tokens: list[int], salt: bytes = b"") -> tuple[int, int]:
        """The free slot whose cached tokens share the longest prefix with ``tokens`` under ``salt``, and how many
        prompt tokens ``admit`` would reuse there. Ties go to the least recently used slot, so a prompt with nothing
        to reuse does not evict another prompt's prefix when it need not."""
        if not free:
            raise Busy("no free slot")
        return max(((slot, self.reusable(slot, tokens, salt)) for slot in free),
                   key=lambda sr: (sr[1], -self._last_used[sr[0]]))

    def reusable(self, slot: int, tokens: list[int], salt: bytes = b"") -> int:
        """Prompt tokens ``slot``'s cells hold for a prompt of ``salt`` (with ``reuse: exact``, in whole chunks
        computed as prompt chunks): none if they were computed under another salt. The last prompt token is always
        computed again (its logits pick the first new token)."""
        if self.salt_of(slot) != salt:
            return 0
        shared = min(common_prefix(self.kv_tokens(slot), tokens), len(tokens) - 1)
        return whole_chunks(min(shared, self.whole_cells(slot))) if self._exact else shared

    def usable(self, n: int) -> int:
        """Of ``n`` leading cells or prompt tokens, how many a prompt may start from (``sequence.usable``)."""
        return usable(n, self._exact)

    def whole_cells(self, slot: int) -> int:
        """The leading cells of ``slot`` that are whole prompt chunks (a running sequence's, or what its last
        request left); generated tokens' cells never are: they were decoded one token at a time."""
        seq = self._running.get(slot)
        return whole_cells(seq) if seq is not None else self.whole[slot]

    def holds_cells(self, slot: int, n: int) -> bool:
        """Whether ``slot``'s memory still has what a token at position ``n`` needs of its first ``n`` cells,
        as llama-server checks it: a sliding-window cache may have dropped cells its window has passed (at
        most ``n - n_swa`` of them), and a recurrent state holds only its last position."""
        if n == 0:
            return True
        pos_min = self._memory.seq_pos_min(slot)
        if 0 <= pos_min <= max(0, n - self._n_swa):
            return True
        if not self._told_cells_missing:
            self._told_cells_missing = True
            instead = ("restores instead the host store's longest entry that is all prefix of it (a checkpoint "
                       "at a whole chunk) and computes the rest" if self._has_store else
                       "is computed from the start (no host store here: cache_ram 0)")
            log.info("this model's sliding-window (or recurrent) layers keep only the last cells of a restored "
                     "state, so a prompt sharing only part of a slot's restored cells cannot keep them: it %s "
                     "(said once)", instead)
        return False

    def salt_of(self, slot: int) -> bytes:
        """The salt ``slot``'s cells were computed under: its running sequence's, or its last request's."""
        seq = self._running.get(slot)
        return seq.salt if seq is not None else self.salts[slot]

    def kv_tokens(self, slot: int) -> list[int]:
        """The tokens whose KV cells ``slot`` holds now: a running sequence's prompt and generated tokens
        decoded so far, else what its last request left."""
        seq = self._running.get(slot)
        return seq.kv_tokens() if seq is not None else self.cached[slot]

    def kv_cells(self, slot: int) -> int:
        """The KV cells ``slot`` holds now: its running sequence's, or what its last request left."""
        seq = self._running.get(slot)
        return seq.n_past if seq is not None else len(self.cached[slot])

    def take_cells(self, slot: int, tokens: list[int], salt: bytes = b"") -> int:
        """Cut ``slot``'s cells after the prefix of ``tokens`` they hold under ``salt``; returns its length. (A
        longer prefix in another slot is copied over by ``catch_up`` before the next step.)"""
        own = self.reusable(slot, tokens, salt)
        if not self._memory.seq_rm(slot, own, -1) or not self.holds_cells(slot, own):
            self._memory.seq_rm(slot, -1, -1)  # whole-sequence removal never fails
            return 0
        return own

    def start(self, slot: int, tokens: list[int], reused: int, text: str, salt: bytes = b"",
              space: bytes = b"", images: Mapping[int, Image] | None = None) -> None:
        """A prompt of ``salt`` (under the adapters of ``space``, with ``images`` by start) admitted into ``slot``
        starts from its first ``reused`` tokens' cells."""
        self.cached[slot] = tokens[:reused]
        self.texts[slot], self.images[slot] = text, images or {}
        self.salts[slot] = salt
        self.spaces[slot] = space
        self.whole[slot] = reused if self._exact else 0  # cells reused at any length are no fresh computation's
        self._uses += 1
        self._last_used[slot] = self._uses
        self.reused += reused

    def catch_up(self, prefilling: Iterable[Sequence]) -> None:
        """Before a step: a prompt still being computed takes over another slot's cells when they hold more
        of it (``reusable``), whether they were there when it was admitted or were computed since (two
        requests with one system prompt, admitted together, compute it once), and computing what they hold
        beyond its own would cost more than the copy (``copy_cost``)."""
        for seq in prefilling:
            if seq.score_prompt:
                continue
            source, shared = self.copy_source(seq.slot, seq.prompt, seq.salt)
            if (shared > seq.n_past and self.copy_cost.worth(shared - seq.n_past)
                    and self.holds_cells(source, shared)):
                self.copy_prefix(source, seq.slot, shared)
                self._count_reused(seq, shared)

    def share(self, lead: Sequence, twins: list[Sequence]) -> list[Sequence]:
        """``twins``, prompts waiting that equal ``lead``'s, whose last chunk was just decoded (the choices of a
        request for n), take all its cells and sample from its last row, so the prompt is computed once and each
        first token comes from the logits a computation of its own would give. The twins that did."""
        if not twins or not self.holds_cells(lead.slot, len(lead.prompt)):
            return []
        for seq in twins:
            self.copy_prefix(lead.slot, seq.slot, len(lead.prompt))
            self._count_reused(seq, len(seq.prompt))
            seq.output_row = lead.output_row
        return twins

    def _count_reused(self, seq: Sequence, n_past: int) -> None:
        self.reused += n_past - seq.n_past
        seq.reused += n_past - seq.n_past
        seq.n_past = n_past

    def copy_source(self, slot: int, tokens: list[int], salt: bytes = b"") -> tuple[int, int]:
        """The other slot whose cells hold the longest prefix of ``tokens`` that a prompt of ``salt`` may reuse,
        and how many tokens of it."""
        return max(((other, self.reusable(other, tokens, salt)) for other in range(self.parallel) if other != slot),
                   key=lambda found: found[1], default=(slot, 0))

    def copy_prefix(self, source: int, slot: int, n: int) -> None:
        """Replace ``slot``'s cells with a copy of ``source``'s first ``n``."""
        memory = self._memory
        memory.seq_rm(slot, -1, -1)
        if self._kv_unified:  # one pool: the cells get a second owner, nothing is copied
            memory.seq_cp(source, slot, 0, n)
        else:  # llama.cpp copies whole streams only (at the next decode): copy, then cut after the prefix
            memory.seq_cp(source, slot, -1, -1)
            memory.seq_rm(slot, n, -1)
        self.copies += 1

    def finished(self, seq: Sequence) -> None:
        """``seq`` left the batch: its slot keeps its cells (all but the last token sampled, which has none)."""
        self.cached[seq.slot] = seq.kv_tokens()
        self.whole[seq.slot] = whole_cells(seq) if self._exact else 0
        self.salts[seq.slot], self.spaces[seq.slot] = seq.salt, seq.space  # (a resumed one came in by ``set``)

    def set(self, slot: int, tokens: list[int], whole: int) -> None:
        """``slot``'s cells were replaced (a slot file restored by the operator, or emptied): they hold ``tokens``,
        for the default tenant's prompts (the empty salt)."""
        self.cached[slot], self.whole[slot], self.texts[slot], self.salts[slot] = tokens, whole, "", b""
        self.spaces[slot], self.images[slot] = b"", {}

    def erase(self, slot: int) -> int:
        """Drop ``slot``'s cells; how many it held."""
        held = len(self.cached[slot])
        self._memory.seq_rm(slot, -1, -1)
        self.set(slot, [], 0)
        return held
