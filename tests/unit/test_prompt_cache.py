"""The host-RAM prompt cache's bookkeeping: least recently used out first, by bytes, never over its size."""

from __future__ import annotations

import pytest

from mpserve.engine.prompt_cache import Changes, PromptCache

pytestmark = pytest.mark.timeout(10)


def test_entries_are_evicted_least_recently_used_first_and_the_bytes_never_exceed_the_size() -> None:
    cache = PromptCache(250)
    for first in range(1, 6):
        cache.put([first, 0, 0], f"state {first}", 100)
        assert cache.stats().bytes <= 250
    stats = cache.stats()
    assert (stats.entries, stats.bytes, stats.evictions) == (2, 200, 3)
    entry, shared = cache.find([4, 0, 0, 9])
    assert entry is not None and (entry.state, shared) == ("state 4", 3)
    cache.put([6, 0], "state 6", 100)  # evicts 5: 4 was used since
    assert cache.find([5, 0, 0]) == (None, 0) and cache.find([4, 0, 0])[0] is not None


def test_an_entry_larger_than_the_cache_is_not_kept_and_zero_keeps_nothing() -> None:
    cache = PromptCache(100)
    cache.put([1, 2], "big", 101)
    assert cache.stats().entries == 0 and not cache.wants(101) and cache.wants(100)
    off = PromptCache(0)
    off.put([1], "s", 1)
    assert off.stats().bytes == 0 and not off.wants(1)
    with pytest.raises(ValueError):
        PromptCache(-1)


def test_a_prefix_of_an_entry_adds_nothing_and_a_longer_entry_replaces_its_prefixes() -> None:
    cache = PromptCache(1000)
    cache.put([1, 2, 3], "short", 10)
    assert cache.holds([1, 2]) and cache.holds([1, 2, 3]) and not cache.holds([1, 2, 3, 4])
    cache.put([1, 2, 3, 4, 5], "long", 20)
    assert cache.stats().entries == 1 and cache.stats().bytes == 20 and cache.stats().evictions == 0
    cache.put([1, 2], "shorter", 5)
    assert cache.stats().entries == 1
    entry, shared = cache.find([1, 2, 3, 9])
    assert entry is not None and (entry.state, shared) == ("long", 3)


def test_hits_and_misses_are_counted_as_told() -> None:
    cache = PromptCache(10)
    cache.count(hit=True)
    cache.count(hit=False)
    cache.count(hit=False)
    assert (cache.stats().hits, cache.stats().misses) == (1, 2)


def test_the_entries_with_a_summary_added_and_dropped_since_the_last_take_are_told_once() -> None:
    cache = PromptCache(250)
    cache.put([1, 0], "a", 100, summary=(11, 12))
    cache.put([2, 0], "b", 100)  # no summary (a prompt of token ids): nothing to tell
    assert cache.take_changes() == Changes(added=((1, (11, 12)),))
    assert not cache.take_changes()  # told once
    cache.put([3, 0], "c", 100, summary=(31,))  # evicts 1
    cache.put([4, 0], "d", 100, summary=(41,))  # evicts 2 (no summary)
    cache.put([5, 0], "e", 100, summary=(51,))  # evicts 3, before it was told
    assert cache.take_changes() == Changes(added=((4, (41,)), (5, (51,))), dropped=(1,))
    cache.put([5, 0, 6], "e longer", 100, summary=(51, 56))  # replaces its prefix, 5
    assert cache.take_changes() == Changes(added=((6, (51, 56)),), dropped=(5,))
    cache.clear()  # the engine closes: the broker forgets the instance's entries when it unloads
    assert not cache.take_changes()


def test_a_snapshot_is_every_entry_with_a_summary_most_recent_kept_within_its_bounds_and_starts_the_changes_afresh(
        ) -> None:
    cache = PromptCache(1000)
    cache.put([1], "a", 10, (11, 12))
    cache.put([2], "b", 10)  # no summary (a prompt of token ids): not told
    cache.put([3], "c", 10, (31,))
    cache.put([4], "d", 10, (41, 42, 43))
    cache.find([1, 5])  # 1 becomes the most recently used
    assert cache.snapshot(10, 100) == Changes(added=((3, (31,)), (4, (41, 42, 43)), (1, (11, 12))))
    assert not cache.take_changes()  # what was pending is in the snapshot
    assert cache.snapshot(2, 100).added == ((4, (41, 42, 43)), (1, (11, 12)))  # at most 2 entries
    assert cache.snapshot(10, 5).added == ((4, (41, 42, 43)), (1, (11, 12)))  # at most 5 hashes
    assert cache.snapshot(10, 1).added == ()  # the most recent alone is over the bound
