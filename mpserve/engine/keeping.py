"""When a slot's cells are saved to the host store, and when a prompt restores them from it.

    prompt chunk decoded ──save_computed(seq, n)──▶ all but its last chunk, a checkpoint, a mark ──▶ HostStore.put
    admit, before the cut ──keep(slot, tokens, salt)───▶ the cells the slot would lose (none another slot or the
                                                   store holds) ──▶ HostStore.put
    admit ──restore(slot, tokens, reused, salt)──▶ HostStore.find ─ more than any slot holds? ─▶ load ─▶ write_state
                                             (a hit: the prompt starts there) or the slot's own ``reused`` (a miss)
    close ──▶ every slot's cells kept, the writes queued finish
    stats / take_changes / snapshot ──▶ the worker (slot table rows, CACHE frames the broker routes by)

The host store (``mpserve.engine.host_store``) is shared by every compatible instance on the host, in RAM with a
disk tier under it. An entry saved from a text prompt carries the block hashes of the text its tokens spell, each
image as its key (``summary_of``): the broker sends a prompt to the instance holding its prefix. Every entry is
saved under the salt its cells were computed under (``mpserve.wire.salt``) and restored for a prompt of that salt
only; its block hashes are keyed with it, so the broker's view of the store matches a prompt of the same salt only.
Cells computed under LoRA adapters (``Sequence.space``) are neither saved nor restored: the store holds the base
model's. What a slot holds and may reuse is ``cells``'; llama.cpp's state bytes come from ``context``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from mpserve.models.builtin import cache_dir
from mpserve.wire import protocol as wire
from mpserve.wire.prefix import block_hashes, common_prefix

from . import host_store, media
from .cells import Cells
from .host_store import HostStore
from .sequence import PROMPT_CHUNK, Sequence, reaches_checkpoint, tail_marks
from .settings import EngineSettings
from .slot_file import Identity
from .store_stats import NO_CACHE, CacheStats, Changes


class States(Protocol):
    """What keeping needs of the llama.cpp context (``mpserve.engine.context.Context``)."""

    bos: list[int]

    def seq_rm(self, slot: int, p0: int, p1: int) -> bool: ...

    def read_state(self, slot: int) -> tuple[Any, int]: ...

    def write_state(self, slot: int, state: Any, size: int) -> bool: ...

    def detokenize(self, tokens: list[int]) -> str: ...


def open_store(settings: EngineSettings, identity: Identity, cut_back: bool, llama_version: str,
               state_version: int) -> HostStore | None:
    """The host store's view for this instance (None: no RAM tier, no store): its compatibility key says what its
    states depend on."""
    if not (settings.cache_ram and settings.cache_shm):
        return None
    digest = host_store.gguf_digest(settings.path, cache_dir() / "digests")
    fields = {"format": host_store.FORMAT, "gguf_sha256": digest,
              "model": identity.model, "type_k": identity.cache_type_k, "type_v": identity.cache_type_v,
              "kv_streams": identity.kv_streams, "flash_attn": settings.flash_attn, "repack": settings.repack,
              "n_gpu_layers": settings.n_gpu_layers, "llama_cpp": llama_version, "state_seq_version": state_version,
              # a state saved with reuse: any may hold cells computed after a prefix of any length, which
              # exact must not start from: the two modes keep their entries apart
              "reuse": "exact" if settings.exact else "any"}
    return HostStore(host_store.compatibility_key(fields), fields, Path(settings.cache_shm), settings.cache_ram,
                     Path(settings.cache_disk) if settings.cache_disk else None, settings.cache_disk_size,
                     settings.n_ctx, cut_back, settings.cache_remote)


class Keeping:
    def __init__(self, store: HostStore | None, cells: Cells, states: States, *, exact: bool, cut_back: bool) -> None:
        self.store, self._cells, self._states, self._exact, self._cut_back = store, cells, states, exact, cut_back
        self.restored = 0  # counter: prompt tokens restored from the store

    def marks(self, tokens: list[int], reused: int, score_prompt: bool) -> tuple[int, ...]:
        """Where a prompt's prefill is split and its cells saved before its end (``sequence.TAIL_MARKS``): with
        ``reuse: any``, on a model whose saved states cannot be cut back, with a store to save to."""
        if self.store is None or self._exact or self._cut_back or score_prompt:
            return ()
        return tail_marks(len(tokens), reused)

    def save_computed(self, seq: Sequence, computed: int) -> None:
        """After each prompt chunk of ``seq`` (``computed`` tokens): once its cells are the most of its prompt a later
        prompt can reuse (all but its last chunk; with ``reuse: exact``, its whole chunks short of its last token),
        save them into the host store (unless it holds them), so that they outlive this instance (a crash, an
        unload, a restart with a disk tier). Saved there, not at the prompt's end: a prompt that extends them
        restores them without a cut, which a state of a sliding-window model needs. Where saved states cannot be
        cut back, also after each chunk that reaches a checkpoint (``reaches_checkpoint``), which a prompt sharing
        part of this one restores, and at its marks before its end (``Sequence.marks``). Chunks run from the cells a
        prompt started from, so with ``reuse: any`` an entry may end anywhere."""
        store, left = self.store, len(seq.prompt) - seq.n_past
        if store is None or seq.score_prompt or seq.space or seq.n_past < PROMPT_CHUNK or left == 0 or not (
                left <= PROMPT_CHUNK or not self._cut_back and reaches_checkpoint(seq.n_past - computed, seq.n_past)):
            return
        kept = seq.prompt[:seq.n_past]
        if store.holds(kept, seq.salt):
            return
        state, size = self._states.read_state(seq.slot)
        if store.wants(size):
            store.put(kept, state, size, self.summary_of(kept, seq.slot, seq.salt), seq.salt)

    def keep(self, slot: int, tokens: list[int], salt: bytes = b"") -> None:
        """Before admitting ``tokens`` (of ``salt``) cuts ``slot``'s cells: save the cells it would lose (all,
        generated tokens included; with ``reuse: exact``, the whole chunks) into the host store under the salt they
        were computed under, unless another slot or the store holds them already. Fewer than a chunk's cells are not
        kept: one decode computes them again, nor cells computed under adapters."""
        cells, store = self._cells, self.store
        whole = cells.whole[slot] if self._exact else len(cells.cached[slot])
        if whole < PROMPT_CHUNK or cells.spaces[slot] or cells.reusable(slot, tokens, salt) >= whole or store is None:
            return
        kept, held_salt = cells.cached[slot][:whole], cells.salts[slot]
        if store.holds(kept, held_salt) or cells.copy_source(slot, kept + [-1], held_salt)[1] >= whole:
            return
        if not self._states.seq_rm(slot, whole, -1) or not cells.holds_cells(slot, whole):
            return  # only whole chunks are worth keeping, and this memory cannot be cut back to them
        state, size = self._states.read_state(slot)
        if store.wants(size):
            store.put(kept, state, size, self.summary_of(kept, slot, held_salt), held_salt)

    def summary_of(self, kept: list[int], slot: int, salt: bytes) -> tuple[int, ...]:
        """The block hashes, keyed with ``salt``, of the part of ``slot``'s text prompt that ``kept`` spells, its
        images by their keys (``media.spelled``; nothing for a prompt of token ids): what the broker routes by."""
        text, images = self._cells.texts[slot], self._cells.images[slot]
        if not text:
            return ()
        spelt = media.spelled(kept, len(self._states.bos), images, self._states.detokenize)
        return block_hashes(text[:common_prefix(spelt, text)], salt)

    def restore(self, slot: int, tokens: list[int], reused: int, salt: bytes = b"") -> int:
        """The prompt tokens ``slot`` starts from: ``reused`` of its own cells, or more restored from the host store
        when it holds more of ``tokens`` under ``salt`` than any slot (with ``reuse: exact``, in whole chunks; a
        hit). A prompt with less than a chunk to reuse does not look (one decode computes it), as a slot's cells are
        not kept for less."""
        cells, store = self._cells, self.store
        reusable = cells.usable(len(tokens) - 1)
        if store is None or reusable < PROMPT_CHUNK:
            return reused
        held = max(reused, cells.copy_source(slot, tokens, salt)[1])
        if held >= reusable:
            return reused  # the slots hold all there is to reuse: no need to look
        entry, shared = store.find(tokens[:reusable], salt)
        restorable = cells.usable(shared)
        loaded = store.load(entry) if entry is not None and restorable > held else None
        if loaded is None:
            store.count(hit=False)
            return reused
        if not write_cells(self._states, cells, slot, loaded, restorable):
            store.count(hit=False)
            return 0
        store.count(hit=True)
        self.restored += restorable
        return restorable

    def stats(self) -> CacheStats:
        return self.store.stats() if self.store is not None else NO_CACHE

    def take_changes(self) -> wire.CacheChanges:
        return _on_wire(self.store.take_changes() if self.store is not None else Changes())

    def snapshot(self) -> wire.CacheChanges:
        if self.store is None:
            return wire.CacheChanges()
        return _on_wire(self.store.snapshot(wire.MAX_CACHE_ITEMS, wire.MAX_CACHE_HASHES))

    def close(self) -> None:
        """What every slot holds goes to the store, as when a prompt that shares nothing cuts it, so that it
        outlives the instance (an unload, a single-active-backend swap, a scale-down); the writes queued finish."""
        if self.store is None:
            return
        for slot in range(self._cells.parallel):
            self.keep(slot, [])
            self._cells.erase(slot)  # the next slot's cells count alone
        self.store.close()
        self.store = None


def write_cells(states: States, cells: Cells, slot: int, loaded: tuple[Any, int], n: int) -> bool:
    """Replace ``slot``'s cells with a state loaded from the host store, cut after its first ``n``; False where
    llama.cpp refused the state or the memory no longer holds what a token at ``n`` needs (the slot then emptied)."""
    states.seq_rm(slot, -1, -1)
    if states.write_state(slot, *loaded) and states.seq_rm(slot, n, -1) and cells.holds_cells(slot, n):
        return True
    states.seq_rm(slot, -1, -1)
    return False


def _on_wire(changes: Changes) -> wire.CacheChanges:
    return wire.CacheChanges(tuple((i, wire.pack_hashes(summary)) for i, summary in changes.added), changes.dropped)
