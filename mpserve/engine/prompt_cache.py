"""What the engine and the worker know of a prompt store (``mpserve.engine.host_store``): its figures, the
changes the broker hears of, and how a sequence's state is copied out of and into a llama.cpp context.

    engine ─read_state(slot)──▶ a byte array (llama_state_seq_get_data) ──▶ HostStore.put
    engine ◀─write_state(slot)── a byte array (llama_state_seq_set_data) ◀── HostStore.load
    HostStore ─stats()────────▶ CacheStats ──▶ the slot table's rows (status, /metrics, the monitor)
    HostStore ─take_changes()─▶ Changes ──▶ CACHE frames (the broker routes by the entries' summaries)
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CacheStats:
    capacity: int  # bytes the RAM tier may hold, for the whole host (0: no store)
    bytes: int  # the RAM tier holds now (every instance's entries, of every model)
    entries: int  # of this instance's model and settings, in either tier
    hits: int  # this instance's prompts that restored a prefix from the store
    misses: int  # ... that looked for one and found nothing the slots did not hold already
    evictions: int  # entries this instance removed from the store's last tier to make room
    disk_bytes: int = 0  # the disk tier holds now
    disk_capacity: int = 0  # it may hold (0: no disk tier)
    skipped: int = 0  # bad entries this instance removed unread, and writes it could not make (a full disk)


NO_CACHE = CacheStats(0, 0, 0, 0, 0, 0)


@dataclass(frozen=True)
class Changes:
    """Entries with a summary added (id, summary) and dropped (id) since the last ``take_changes``."""

    added: tuple[tuple[int, tuple[int, ...]], ...] = ()
    dropped: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.dropped)


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
