"""What one host's store holds for one model, as the broker knows it: the summary of each entry (the block hashes
of the prompt text it holds, ``mpserve.wire.prefix.block_hashes``), from the CACHE frames the DONEs, ERRORs and READYs
of the model's instances on that host carry. An entry's id is the same whichever instance saved it (its content
address), so the view is the host's (``ModelQueue.store``): it outlives the instances, as the store does.

    worker: an entry saved ─┐                     ┌─▶ apply(changes): entries added, entries dropped
            entries evicted ┴─ DONE + CACHE ─────▶┤
                                                  └─▶ longest(prompt's block hashes): the characters of the
                                                      prompt's longest prefix some entry holds (routing)
    READY + CACHE (what the store holds) ──▶ apply: a broker that restarted, or a new instance, learns what the
                                             host's store kept

The view may lag or miss (an entry evicted after the last CACHE frame): it only steers routing, and the
worker restores what it really holds, so a stale view costs a prompt computed instead of restored, never a
wrong result. It is bounded whatever a worker sends: past ``wire.MAX_CACHE_HASHES`` hashes the entries heard
of first are forgotten first.
"""

from __future__ import annotations

from collections.abc import Sequence

from mpserve.wire import protocol as wire
from mpserve.wire.prefix import PREFIX_BLOCK


class RamPrefixes:
    def __init__(self, limit: int = wire.MAX_CACHE_HASHES) -> None:
        self.limit = limit
        self._entries: dict[int, tuple[int, ...]] = {}  # id -> its block hashes, heard of first first
        self._holders: dict[int, int] = {}  # block hash -> the entries holding it
        self._held = 0  # hashes over all entries

    def __bool__(self) -> bool:
        return bool(self._entries)

    def apply(self, changes: wire.CacheChanges) -> None:
        """The entries a CACHE frame says were dropped and added (ids not heard of are ignored)."""
        for entry in changes.dropped:
            self._drop(entry)
        for entry, packed in changes.added:
            hashes = wire.unpack_hashes(packed)
            if not hashes or entry in self._entries:
                continue
            self._entries[entry] = hashes
            for h in hashes:
                self._holders[h] = self._holders.get(h, 0) + 1
            self._held += len(hashes)
            while self._held > self.limit:
                self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self._holders.clear()
        self._held = 0

    def longest(self, blocks: Sequence[int]) -> int:
        """The characters of the longest prefix of a prompt (``blocks``: its block hashes) that an entry holds, in
        whole blocks. An entry holding a prefix holds every shorter one, so a binary search finds it."""
        lo, hi = 0, len(blocks)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if blocks[mid - 1] in self._holders:
                lo = mid
            else:
                hi = mid - 1
        return lo * PREFIX_BLOCK

    def _drop(self, entry: int) -> None:
        hashes = self._entries.pop(entry, ())
        for h in hashes:
            left = self._holders[h] - 1
            if left:
                self._holders[h] = left
            else:
                del self._holders[h]
        self._held -= len(hashes)
