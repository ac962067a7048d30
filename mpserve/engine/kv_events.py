"""Which blocks of tokens an instance's KV cache holds, told as the changes since the last time it was asked: the
events of vLLM's format (``mpserve.wire.kv_events``), recorded in a plain list for the worker to publish.

    the slots' cells (Cells.held: tokens, reuse key, adapters per slot) ──Ledger.observe──▶ each slot's whole blocks,
        hashed (only the blocks past what it held before) ──the instance's count per hash──▶ BlockStored for a hash
        the instance now holds and did not, BlockRemoved for one it no longer holds
    the host store's entries this instance wrote and removed (BatchEngine.kv_stored) ──Ledger.entry──▶ the same,
        medium CPU

A hash held by two slots (a shared prefix) is one block of the instance, as vLLM's prefix cache shares it: stored
when the first slot holds it, removed when the last lets it go. The ledger does nothing until asked, so an engine
without KV events pays nothing. This module never touches a socket (the engine does not import zmq): the worker's
``mpserve.worker.kv_publisher`` sends what ``observe`` returns.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpserve.wire.kv_events import (
    BLOCK_SIZE,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    block_hashes,
)

if TYPE_CHECKING:
    from .cells import Cells
    from .host_store import HostStore


@dataclass(frozen=True)
class Held:
    """What one slot's cells hold: ``tokens`` computed under the reuse ``key`` with the LoRA ``adapters`` (names,
    "" for none, joined by "+")."""

    tokens: Sequence[int]
    key: bytes = b""
    adapters: str = ""


@dataclass
class _Slot:
    tokens: list[int]  # the tokens of its whole blocks, as hashed
    key: bytes
    hashes: list[int]


class Ledger:
    """The blocks one instance holds, by slot, and the events that tell their changes."""

    def __init__(self, medium: str = MEDIUM_GPU) -> None:
        self._medium = medium
        self._slots: dict[object, _Slot] = {}  # a slot (GPU) or a host-store entry (CPU) -> its blocks
        self._count: Counter[int] = Counter()  # hash -> the slots that hold it

    def observe(self, held: Sequence[Held]) -> list[Event]:
        """The events since the last call, given what each slot holds now (slot i: ``held[i]``)."""
        events: list[Event] = []
        for slot, now in enumerate(held):
            self._update(slot, now, events)
        return events

    def entry(self, name: object, held: Held | None) -> list[Event]:
        """A host-store entry written (``held``: its tokens and key) or removed (None)."""
        events: list[Event] = []
        self._update(name, held or Held(()), events)
        if held is None:
            self._slots.pop(name, None)
        return events

    def clear(self) -> list[Event]:
        """Nothing is held any more (a model unloaded, an instance started): AllBlocksCleared."""
        self._slots.clear()
        self._count.clear()
        return [AllBlocksCleared()]

    def hashes(self) -> set[int]:
        """Every hash the instance holds now."""
        return set(self._count)

    def _update(self, slot: object, now: Held, events: list[Event]) -> None:
        whole = len(now.tokens) - len(now.tokens) % BLOCK_SIZE
        before = self._slots.get(slot) or _Slot([], now.key, [])
        kept = _kept_blocks(before, now, whole)
        if kept == len(before.hashes) and kept * BLOCK_SIZE == whole:
            return  # nothing changed (the usual case: a token short of the next whole block)
        tokens = list(now.tokens[:whole])
        parent = before.hashes[kept - 1] if kept else None
        hashes = before.hashes[:kept] + block_hashes(tokens, now.key, kept, parent)
        self._slots[slot] = _Slot(tokens, now.key, hashes)
        gone = [h for h in before.hashes[kept:] if self._release(h)]
        if gone:
            events.append(BlockRemoved(gone, self._medium))
        self._store(hashes, tokens, kept, now.adapters, events)

    def _release(self, block: int) -> bool:
        """One slot less holds ``block``; whether none does now."""
        self._count[block] -= 1
        if self._count[block] > 0:
            return False
        del self._count[block]
        return True

    def _store(self, hashes: list[int], tokens: list[int], start: int, adapters: str, events: list[Event]) -> None:
        """Count blocks ``start``.. of a slot, telling each run of those the instance did not hold as one
        BlockStored (a run's parent: the block before it)."""
        runs: list[list[int]] = []
        for index in range(start, len(hashes)):
            if self._count[hashes[index]] == 0:
                if runs and runs[-1][-1] == index - 1:
                    runs[-1].append(index)
                else:
                    runs.append([index])
            self._count[hashes[index]] += 1
        for run in runs:
            first, end = run[0], run[-1] + 1
            events.append(BlockStored(hashes[first:end], hashes[first - 1] if first else None,
                                      tokens[first * BLOCK_SIZE:end * BLOCK_SIZE], BLOCK_SIZE, None, self._medium,
                                      adapters or None))


def _kept_blocks(before: _Slot, now: Held, whole: int) -> int:
    """How many of the blocks ``before`` hashed the slot still holds: those of the longest common prefix of whole
    blocks (none under another key)."""
    if before.key != now.key:
        return 0
    n = min(len(before.hashes), whole // BLOCK_SIZE)
    new = list(now.tokens[:n * BLOCK_SIZE])
    if before.tokens[:n * BLOCK_SIZE] == new:
        return n
    lo, hi = 0, n - 1
    while lo < hi:  # the longest run of whole blocks they share: a binary search, each comparison a slice's, in C
        mid = (lo + hi + 1) // 2
        if before.tokens[:mid * BLOCK_SIZE] == new[:mid * BLOCK_SIZE]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def adapter_names(adapters: Iterable[tuple[str, float]]) -> str:
    """A slot's adapters as the events name them: the names, sorted, joined by "+"."""
    return "+".join(sorted(name for name, scale in adapters if scale))


def held(cells: Cells, adapters: Sequence[Iterable[tuple[str, float]]]) -> list[Held]:
    """What each slot's cells hold (tokens, reuse key, ``adapters[slot]``'s names), for ``Ledger.observe``."""
    return [Held(cells.kv_tokens(slot), cells.salt_of(slot), adapter_names(chosen))
            for slot, chosen in enumerate(adapters)]


def stored(store: HostStore | None) -> list[tuple[str, Held | None]]:
    """The host-store entries this instance wrote (their tokens and key) and removed (None) since the last call, for
    ``Ledger.entry``; the first call starts recording them."""
    log = store.take_kv_log() if store is not None else []
    return [(name, Held(tokens, salt) if tokens is not None else None) for name, tokens, salt in log]
