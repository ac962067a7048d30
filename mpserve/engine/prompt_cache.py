"""A host-RAM prompt cache: slot states kept after their KV cells were overwritten, restored for a prompt that
starts with their tokens (llama-server's ``--cache-ram``).

    admit(slot, prompt) ─▶ the slot's cells are about to be cut ─▶ put(tokens, state)   (llama_state_seq_get_data)
                       └─▶ the slots hold less of the prompt ─────▶ find(prompt)        (llama_state_seq_set_data)

An entry is one sequence's state, its cells for ``tokens`` (whole prompt chunks only, so a restored prefix
is as exact as a reused one), with its bytes. Entries are kept least recently used first and evicted from
there until the bytes held fit the capacity; the cache never holds more than that, and an entry larger
than the whole capacity is not kept. An entry whose tokens begin another's adds nothing and is dropped
(the longer one serves both). An entry may carry a summary (the block hashes of the prompt text its tokens
spell, ``mpserve.prefix.block_hashes``): the entries with one that were added and dropped since the last
``take_changes`` are what the broker hears of, so that it routes a prompt to the instance holding its prefix
(and ``snapshot``, all of them, what it hears when the worker registers).
``read_state`` and ``write_state`` copy a sequence's state out of and into a
llama.cpp context; which slot to save and when to restore is the engine's choice.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mpserve.prefix import common_prefix


@dataclass(frozen=True)
class CacheStats:
    capacity: int  # bytes the cache may hold (0: off)
    bytes: int  # held now
    entries: int
    hits: int  # prompts that restored a prefix from the cache
    misses: int  # prompts that looked for one and found nothing the slots did not hold already
    evictions: int  # entries dropped to make room


NO_CACHE = CacheStats(0, 0, 0, 0, 0, 0)


@dataclass(frozen=True)
class Entry:
    tokens: tuple[int, ...]
    state: Any  # the state as llama.cpp wrote it (a ctypes byte array: kept without a copy)
    size: int
    id: int = 0  # unique in this cache
    summary: tuple[int, ...] = ()  # what the broker routes by (empty: nothing, e.g. a prompt of token ids)


@dataclass(frozen=True)
class Changes:
    """Entries with a summary added (id, summary) and dropped (id) since the last ``take_changes``."""

    added: tuple[tuple[int, tuple[int, ...]], ...] = ()
    dropped: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.dropped)


class PromptCache:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"the prompt cache's capacity must be >= 0 bytes, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()  # least recently used first
        self._bytes = self._hits = self._misses = self._evictions = 0
        self._ids = 0
        self._added: dict[int, tuple[int, ...]] = {}  # since the last take_changes
        self._dropped: list[int] = []

    def wants(self, size: int) -> bool:
        """Whether an entry of ``size`` bytes can be kept at all (the state need not be read otherwise)."""
        return 0 < size <= self.capacity

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether an entry holds ``tokens`` (as a prefix of its own): saving them again adds nothing."""
        key = tuple(tokens)
        return any(entry[:len(key)] == key for entry in self._entries)

    def put(self, tokens: Sequence[int], state: Any, size: int, summary: tuple[int, ...] = ()) -> None:
        """Keep ``state``, the cells of ``tokens``, as the most recently used entry; evict until it fits."""
        key = tuple(tokens)
        if not self.wants(size) or self.holds(key):
            return
        for shorter in [k for k in self._entries if key[:len(k)] == k]:  # now served by this longer one
            self._drop(shorter)
        while self._bytes + size > self.capacity:
            self._drop(next(iter(self._entries)))
            self._evictions += 1
        self._ids += 1
        self._entries[key] = Entry(key, state, size, self._ids, summary)
        self._bytes += size
        if summary:
            self._added[self._ids] = summary

    def find(self, tokens: Sequence[int]) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with ``tokens``, and that prefix's length; it becomes the most
        recently used. (None, 0) when no entry shares anything."""
        key = tuple(tokens)
        best, shared = None, 0
        for entry in self._entries.values():
            n = common_prefix(entry.tokens, key)
            if n > shared:
                best, shared = entry, n
        if best is not None:
            self._entries.move_to_end(best.tokens)
        return best, shared

    def count(self, hit: bool) -> None:
        """One prompt that looked in the cache: it restored a prefix from it, or it found nothing better."""
        if hit:
            self._hits += 1
        else:
            self._misses += 1

    def stats(self) -> CacheStats:
        return CacheStats(self.capacity, self._bytes, len(self._entries), self._hits, self._misses, self._evictions)

    def take_changes(self) -> Changes:
        """The entries with a summary added and dropped since the last call (one added and dropped in between
        is in neither)."""
        changes = Changes(tuple(self._added.items()), tuple(self._dropped))
        self._added, self._dropped = {}, []
        return changes

    def snapshot(self, max_entries: int, max_hashes: int) -> Changes:
        """The entries with a summary, as added: the most recently used, up to ``max_entries`` entries and
        ``max_hashes`` hashes, least recently used first. What ``take_changes`` had gathered is in it, so that
        starts afresh."""
        added: list[tuple[int, tuple[int, ...]]] = []
        hashes = 0
        for entry in reversed(self._entries.values()):
            if not entry.summary:
                continue
            if len(added) == max_entries or hashes + len(entry.summary) > max_hashes:
                break
            added.append((entry.id, entry.summary))
            hashes += len(entry.summary)
        self._added, self._dropped = {}, []
        return Changes(tuple(reversed(added)))

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0
        self._added, self._dropped = {}, []

    def _drop(self, key: tuple[int, ...]) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.size
        if entry.summary and self._added.pop(entry.id, None) is None:
            self._dropped.append(entry.id)


def read_state(lib: Any, ctx: Any, seq: int) -> tuple[Any, int]:
    """Sequence ``seq``'s state (its KV cells) as a byte array, and its size (0: nothing to read)."""
    size = lib.llama_state_seq_get_size(ctx, seq)
    if not size:
        return None, 0
    buffer = (ctypes.c_uint8 * size)()
    written = lib.llama_state_seq_get_data(ctx, buffer, size, seq)
    return (buffer, written) if written == size else (None, 0)


def write_state(lib: Any, ctx: Any, seq: int, state: Any, size: int) -> bool:
    """Replace sequence ``seq``'s cells with ``state`` (from ``read_state``); False if llama.cpp refused it, which
    leaves the sequence empty."""
    return bool(lib.llama_state_seq_set_data(ctx, state, size, seq))  # the bytes read; 0: failed
