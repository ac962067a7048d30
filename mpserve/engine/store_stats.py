"""What the engine and the worker know of the host store (``mpserve.engine.host_store``): its figures and the
changes the broker hears of (a sequence's state is copied out of and into a context by ``context.Context``).

    HostStore ─stats()────────▶ CacheStats ──▶ the slot table's rows (status, /metrics, the monitor)
    RemoteStore ─stats()──────▶ RemoteStats ─┘ (its part: the remote tier's hits, misses, errors, dropped writes)
    HostStore ─take_changes()─▶ Changes ──▶ CACHE frames (the broker routes by the entries' summaries)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RemoteStats:
    hits: int = 0  # lookups that restored an entry from the remote tier
    misses: int = 0  # ... that found none, or only bad ones, or were made while it was aside
    errors: int = 0  # calls that failed (refused, timed out, an error answer)
    dropped: int = 0  # writes not made: the queue was full, or the tier was aside


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
    remote: RemoteStats = RemoteStats()  # this instance's use of the remote tier (all 0: none)


NO_CACHE = CacheStats(0, 0, 0, 0, 0, 0)


@dataclass(frozen=True)
class Changes:
    """Entries with a summary added (id, summary) and dropped (id) since the last ``take_changes``."""

    added: tuple[tuple[int, tuple[int, ...]], ...] = ()
    dropped: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.dropped)
