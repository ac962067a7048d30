"""Parking: a running sequence taken out of the batch whole, and put back where it stopped (priority preemption:
``mpserve.server.preemption``).

    park(slot, key)   the slot's Sequence out of the scheduler, its KV cells read out (``Context.read_state``) ──▶
                      held under ``key`` in this process (``Parked``); the slot is free and counted empty
    resume(key, slot, on_token)   the cells written into free ``slot`` as they were read, the Sequence back into the
                      scheduler with its sampler, text stream and log-probabilities as they were ──▶ it decodes on
    drop(key)         a parked sequence forgotten (its request ended while parked)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .cells import Cells
from .context import Context
from .interface import OnToken
from .scheduler import Scheduler
from .sequence import Sequence, whole_cells

log = logging.getLogger("mpserve.engine")


@dataclass(frozen=True)
class Parked:
    """A sequence out of the batch (preempted: ``mpserve.server.preemption``), whole: its Sequence object as it was
    between two steps (its sampler chain, so a seeded sampler's random state, a grammar's state and the penalties'
    window go on where they were; its text stream with what it holds back; its log-probabilities not yet taken),
    and its slot's KV cells read out (``Context.read_state``: ``size`` bytes, none before its first decode). Held in
    this process's memory, not the host store, which may evict an entry or hold only whole chunks of it:
    written back into a slot, the cells are the very ones it had, so it decodes on as if never stopped."""

    seq: Sequence
    state: Any
    size: int


class Parking:
    """The sequences parked in one engine, by key."""

    def __init__(self, context: Context, cells: Cells, scheduler: Scheduler) -> None:
        self._context = context
        self._cells = cells
        self._scheduler = scheduler
        self._parked: dict[str, Parked] = {}

    def park(self, slot: int, key: str) -> bool:
        """Take the sequence running in ``slot`` out of the batch, held under ``key`` with its KV cells read out
        (``Parked``); the slot is free and counted empty (left for reuse, its cells would be copied into the host
        store when the next prompt cuts them, on the path of the request that preempted it). False if nothing runs
        there (it ended) or a cancel ends it."""
        seq = self._scheduler.running.get(slot)
        if seq is None or seq.cancel_requested:
            return False
        state, size = self._context.read_state(slot) if seq.n_past else (None, 0)
        if seq.n_past and not size:
            log.warning("llama.cpp could not read slot %d's cells; its sequence runs on, not parked", slot)
            return False
        self._scheduler.remove(seq)
        self._cells.set(slot, [], 0)
        self._parked[key] = Parked(seq, state, size)
        return True

    def resume(self, key: str, slot: int, on_token: OnToken) -> bool:
        """Put the sequence parked under ``key`` back into free ``slot``, its cells written there as they were read,
        its text now going to ``on_token``: it goes on from the token it was to decode next, with the same sampler
        (random state, grammar, penalties). False if nothing is parked under ``key`` (or llama.cpp refused the
        cells: then it is dropped, and the caller starts the request again)."""
        parked = self._parked.pop(key, None)
        if parked is None:
            return False
        if not 0 <= slot < self._cells.parallel or slot in self._scheduler.running:
            self._parked[key] = parked
            raise ValueError(f"slot {slot} is not a free slot of 0..{self._cells.parallel - 1}")
        seq = parked.seq
        if parked.size:
            if not self._context.write_state(slot, parked.state, parked.size):
                log.warning("llama.cpp refused a parked sequence's cells; it starts again in slot %d", slot)
                self._cells.erase(slot)
                seq.sampler.close()
                return False
        else:
            self._context.seq_rm(slot, -1, -1)
        self._cells.set(slot, seq.kv_tokens(), whole_cells(seq))
        seq.slot, seq.on_token = slot, on_token
        self._scheduler.add(seq)
        return True

    def drop(self, key: str) -> None:
        """Forget the sequence parked under ``key``, if one is."""
        parked = self._parked.pop(key, None)
        if parked is not None:
            parked.seq.sampler.close()

    def close(self) -> None:
        """Every parked sequence forgotten (the engine closes)."""
        for key in list(self._parked):
            self.drop(key)
