"""A fake KV memory and sequences for the engine's bookkeeping tests: positions per slot, no llama.cpp."""

from __future__ import annotations

from typing import Any, cast

from mpserve.engine.sequence import Phase, Sequence


class FakeMemory:
    """Each slot's cells as the positions they hold (``fill`` from ``first`` on: a window that dropped the cells
    before). ``cut``: whether a sequence can be cut at a position (False: a memory that keeps only whole states, as a
    recurrent one does)."""

    def __init__(self, parallel: int, cut: bool = True) -> None:
        self.cells: list[list[int]] = [[] for _ in range(parallel)]
        self.cut = cut
        self.calls: list[tuple[Any, ...]] = []

    def fill(self, slot: int, n: int, first: int = 0) -> None:
        self.cells[slot] = list(range(first, n))

    def seq_rm(self, slot: int, p0: int, p1: int) -> bool:
        self.calls.append(("rm", slot, p0, p1))
        assert p1 == -1
        if p0 == -1:
            self.cells[slot] = []
            return True
        if not self.cut and any(pos >= p0 for pos in self.cells[slot]):
            return False
        self.cells[slot] = [pos for pos in self.cells[slot] if pos < p0]
        return True

    def seq_cp(self, source: int, slot: int, p0: int, p1: int) -> None:
        self.calls.append(("cp", source, slot, p0, p1))
        held = self.cells[source] if p0 == -1 else [pos for pos in self.cells[source] if p0 <= pos < p1]
        self.cells[slot] = sorted(set(self.cells[slot]) | set(held))

    def seq_pos_min(self, slot: int) -> int:
        return min(self.cells[slot], default=-1)


def sequence(slot: int, prompt: list[int], n_past: int = 0, *, decoding: bool = False) -> Sequence:
    """A sequence in ``slot`` with ``n_past`` cells computed (no sampler: the bookkeeping never samples)."""
    seq = Sequence(slot, prompt, n_past, 16, cast(Any, None), cast(Any, None), lambda text, n: True)
    if decoding:
        seq.phase = Phase.DECODE
    return seq
