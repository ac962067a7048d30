"""The KV events' bookkeeping and format, without a model: vLLM's msgpack layout to the byte, the documented hash,
and the ledger's events, which rebuild exactly the blocks the slots hold, a block shared by two slots told once."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from mpserve.engine.kv_events import Held, Ledger
from mpserve.wire.kv_events import (
    BLOCK_SIZE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
    block_hash,
    block_hashes,
    decode_batch,
    encode_batch,
)

B = BLOCK_SIZE


def rebuild(held: set[int], events: list[Event]) -> set[int]:
    """A subscriber's view: the hashes held after ``events``."""
    for event in events:
        if isinstance(event, AllBlocksCleared):
            held.clear()
        elif isinstance(event, BlockStored):
            assert len(event.token_ids) == len(event.block_hashes) * event.block_size
            parent = event.parent_block_hash
            for i, h in enumerate(event.block_hashes):  # each hash follows from its parent and tokens, alone
                assert h == block_hash(parent, event.token_ids[i * B:(i + 1) * B], KEYS[h])
                parent = h
            assert not held & set(event.block_hashes)
            held |= set(event.block_hashes)
        else:
            assert set(event.block_hashes) <= held
            held -= set(event.block_hashes)
    return held


KEYS: dict[int, bytes] = {}  # hash -> the key it was computed under (the test's record, for the check above)


def expected(slots: list[Held]) -> set[int]:
    hashes: set[int] = set()
    for h in slots:
        for value in block_hashes(h.tokens, h.key):
            KEYS[value] = h.key
            hashes.add(value)
    return hashes


@pytest.mark.timeout(10)
def test_the_hash_is_the_documented_sha256_recipe() -> None:
    tokens = list(range(B))
    data = b"mpserve-kv/1\0" + (0).to_bytes(8, "big") + bytes([3]) + b"abc" + b"".join(
        t.to_bytes(4, "big") for t in tokens)
    first = int.from_bytes(hashlib.sha256(data).digest()[:8], "big")
    assert block_hash(None, tokens, b"abc") == first
    assert block_hashes(tokens * 2 + [1], b"abc") == [first, block_hash(first, tokens, b"abc")]  # whole blocks only
    assert block_hash(None, tokens) != first  # another key (tenant, adapters): another hash


@pytest.mark.timeout(10)
def test_a_batch_is_vllm_s_msgpack_arrays_with_the_tag_first() -> None:
    batch = KVEventBatch(1.5, [BlockStored([7], None, list(range(B)), B, None, "GPU", "a0"), BlockRemoved([7], "GPU"),
                               AllBlocksCleared()], 2)
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert raw == [1.5, [["BlockStored", [7], None, list(range(B)), B, None, "GPU", "a0"], ["BlockRemoved", [7], "GPU"],
                         ["AllBlocksCleared"]], 2]
    assert decode_batch(encode_batch(batch)) == batch


@pytest.mark.timeout(10)
def test_the_events_rebuild_what_the_slots_hold_as_they_grow_share_and_change() -> None:
    ledger, view = Ledger(), set[int]()
    common = list(range(100, 100 + 2 * B))
    runs = [
        [Held(common[:5]), Held([])],  # less than a block: nothing told
        [Held(common + [1, 2, 3]), Held([])],  # two whole blocks
        [Held(common + [1, 2, 3] + list(range(B))), Held(common)],  # slot 1 shares both: told once
        [Held([9] * (3 * B)), Held(common)],  # slot 0 holds something else: its blocks not shared go
        [Held([9] * (3 * B), b"tenant"), Held(common + [5] * B, b"", "a0")],  # another key: other hashes
        [Held([]), Held([])],
    ]
    for slots in runs:
        events = ledger.observe(slots)
        holds = expected(slots)
        assert rebuild(view, events) == holds == ledger.hashes()
    assert view == set()
    assert rebuild({1, 2}, ledger.clear()) == set()


@pytest.mark.timeout(10)
def test_a_shared_block_is_stored_once_and_removed_with_its_last_holder() -> None:
    ledger = Ledger()
    tokens = list(range(2 * B))
    (stored,) = ledger.observe([Held(tokens), Held([])])
    assert isinstance(stored, BlockStored) and stored.parent_block_hash is None and len(stored.block_hashes) == 2
    assert ledger.observe([Held(tokens), Held(tokens)]) == []
    assert ledger.observe([Held([]), Held(tokens)]) == []
    (removed,) = ledger.observe([Held([]), Held(tokens[:B])])
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [stored.block_hashes[1]]
    (more,) = ledger.observe([Held([]), Held(tokens[:B] + [5] * B, b"", "a0")])
    assert isinstance(more, BlockStored) and more.parent_block_hash == stored.block_hashes[0]
    assert more.lora_name == "a0" and more.token_ids == [5] * B


@pytest.mark.timeout(10)
def test_host_store_entries_sharing_a_prefix_keep_it_until_the_last_is_removed() -> None:
    ledger, view = Ledger("CPU"), set[int]()
    short, long = list(range(2 * B)), list(range(4 * B))
    first, holds = expected([Held(short)]), expected([Held(long)])
    assert rebuild(view, ledger.entry("a.kv", Held(short))) == first
    assert rebuild(view, ledger.entry("b.kv", Held(long))) == holds
    assert rebuild(view, ledger.entry("a.kv", None)) == holds  # b holds a's blocks too
    assert rebuild(view, ledger.entry("c.kv", None)) == holds  # an entry it never wrote: nothing to tell
    assert rebuild(view, ledger.entry("b.kv", None)) == set()
