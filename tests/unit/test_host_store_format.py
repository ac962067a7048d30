"""The host store's entry format (mpserve.engine.host_store) from its documented layout, built here byte by byte:

    MAGIC · header length (u32 LE) · CRC32 of the rest (u32 LE) · header (JSON: key, tokens, state bytes, summary)
    · tokens (int32 LE) · state, named ADDRESS.kv (a digest of the key and the tokens) in the key's folder

The store writes exactly that, reads what was built by hand, and skips and removes each kind of bad file, saying
which in its log, whether the listing finds it bad (the header) or the load does (the whole file)."""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from mpserve.engine.host_store import MAX_HEADER_BYTES, HostStore, compatibility_key

pytestmark = pytest.mark.timeout(30)

MAGIC = b"MPKVST01"
KEY = compatibility_key({"model": "format"})
STATE = bytes(range(256)) * 2


def address(tokens: tuple[int, ...], key: str = KEY) -> str:
    return hashlib.sha256(key.encode() + struct.pack(f"<{len(tokens)}i", *tokens)).hexdigest()[:32] + ".kv"


def entry_file(tokens: tuple[int, ...], state: bytes = STATE, key: str = KEY, summary: tuple[int, ...] | None = (),
               magic: bytes = MAGIC, pad: int = 0, header: bytes | None = None) -> bytes:
    fields: dict[str, object] = {"key": key, "tokens": len(tokens), "state_bytes": len(state)}
    if summary is not None:
        fields["summary"] = list(summary)
    head = (json.dumps(fields).encode() if header is None else header) + b" " * pad
    rest = head + struct.pack(f"<{len(tokens)}i", *tokens) + state
    return magic + struct.pack("<II", len(head), zlib.crc32(rest)) + rest


@pytest.fixture
def store(tmp_path: Path) -> Iterator[HostStore]:
    s = HostStore(KEY, {"model": "format"}, tmp_path / "ram", 1 << 24)
    yield s
    s.close()


def folder(s: HostStore, tmp_path: Path) -> Path:
    return tmp_path / "ram" / s.key


def test_the_key_is_a_digest_of_the_fields_in_any_order() -> None:
    fields = {"model": "m", "cache_type_k": "f16", "parallel": 4}
    key = compatibility_key(fields)
    assert key == hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]
    assert compatibility_key(dict(reversed(list(fields.items())))) == key  # the order fields were set in: no matter
    assert compatibility_key({**fields, "parallel": 1}) != key


def test_the_store_writes_the_documented_layout_under_the_tokens_address(store: HostStore, tmp_path: Path) -> None:
    store.put([1, 2, 3], bytearray(STATE), len(STATE), (7, 8))
    store.flush()
    (written,) = folder(store, tmp_path).glob("*.kv")
    assert written.name == address((1, 2, 3))
    assert written.read_bytes() == entry_file((1, 2, 3), summary=(7, 8))


def test_an_entry_built_by_hand_is_found_and_loaded_and_a_header_without_a_summary_has_none(
        store: HostStore, tmp_path: Path) -> None:
    (folder(store, tmp_path) / address((4, 5))).write_bytes(entry_file((4, 5), summary=(9,)))
    (folder(store, tmp_path) / address((6,))).write_bytes(entry_file((6,), summary=None))
    assert {(e.tokens, e.summary) for e in store._refresh()} == {((4, 5), (9,)), ((6,), ())}
    for tokens in ((4, 5, 1), (6, 1)):
        entry, shared = store.find(tokens)
        assert entry is not None and shared == len(tokens) - 1
        loaded = store.load(entry)
        assert loaded is not None and bytes(loaded[0]) == STATE and loaded[1] == len(STATE)
    assert store.stats().skipped == 0


def test_a_header_of_exactly_the_longest_length_is_read(store: HostStore, tmp_path: Path) -> None:
    plain = len(json.dumps({"key": KEY, "tokens": 1, "state_bytes": len(STATE), "summary": []}))
    (folder(store, tmp_path) / address((3,))).write_bytes(entry_file((3,), pad=MAX_HEADER_BYTES - plain))
    assert [e.tokens for e in store._refresh()] == [(3,)]


def skipped(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage().split(" skipped and removed: ", 1)[1] for r in caplog.records
            if " skipped and removed: " in r.getMessage()]


FOREIGN = compatibility_key({"model": "another"})
HEADER_BAD = [  # (what the file is, its bytes, its name, the reason the listing gives)
    ("shorter than the prefix", MAGIC + b"\x00", address((1,)), "not a store entry"),
    ("another magic", entry_file((1,), magic=b"MPKVST99"), address((1,)), "not a store entry"),
    ("a header over the longest", MAGIC + struct.pack("<II", MAX_HEADER_BYTES + 1, 0) + b"{}",
     address((1,)), "its header is too long"),
    ("tokens cut short", entry_file((1, 2, 3))[:-len(STATE) - 2], address((1, 2, 3)),
     f"truncated: its counts say {len(entry_file((1, 2, 3)))} bytes, the file has "
     f"{len(entry_file((1, 2, 3))) - len(STATE) - 2}"),
    ("a header that is not JSON", entry_file((1,), header=b"{not json"), address((1,)), "its header is not JSON"),
    ("another key's entry", entry_file((1,), key=FOREIGN), address((1,)), "foreign (saved under another key)"),
    ("another address", entry_file((1,)), address((2,)), "its name is not its tokens' address"),
]


@pytest.mark.parametrize("what, data, name, reason", HEADER_BAD, ids=[h[0] for h in HEADER_BAD])
def test_a_bad_file_seen_in_the_listing_is_skipped_removed_counted_and_named(
        store: HostStore, tmp_path: Path, caplog: pytest.LogCaptureFixture, what: str, data: bytes, name: str,
        reason: str) -> None:
    path = folder(store, tmp_path) / name
    path.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="mpserve.worker"):
        assert store._refresh() == []
    assert skipped(caplog) == [reason]
    assert f"store entry {name} (ram tier) skipped and removed" in caplog.text
    assert not path.exists() and store.stats().skipped == 1


def damaged_crc(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


def with_crc(data: bytes) -> bytes:
    """``data`` with its CRC made right again (a file damaged where the CRC cannot tell)."""
    return data[:12] + struct.pack("<I", zlib.crc32(data[16:])) + data[16:]


LOAD_BAD = [  # (what the file became after it was listed, its bytes, the reason the load gives)
    ("another magic", entry_file((1,), magic=b"MPKVST99"), "not a store entry"),
    ("a flipped bit", damaged_crc(entry_file((1,))), "truncated or damaged (CRC)"),
    ("only the prefix", MAGIC + struct.pack("<II", 0, 0), "its header is not JSON"),
    ("another key's entry", entry_file((1,), key=FOREIGN), "foreign (saved under another key)"),
    ("state cut short", with_crc(entry_file((1,))[:-5]),
     f"truncated: its counts say {len(entry_file((1,)))} bytes, the file has {len(entry_file((1,))) - 5}"),
    ("another entry's tokens", entry_file((2,)), "its name is not its tokens' address"),
]


@pytest.mark.parametrize("what, data, reason", LOAD_BAD, ids=[b[0] for b in LOAD_BAD])
def test_a_file_gone_bad_after_it_was_listed_is_not_loaded_and_is_skipped_removed_and_named(
        store: HostStore, tmp_path: Path, caplog: pytest.LogCaptureFixture, what: str, data: bytes,
        reason: str) -> None:
    path = folder(store, tmp_path) / address((1,))
    path.write_bytes(entry_file((1,)))
    entry, _ = store.find((1, 9))
    assert entry is not None
    path.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="mpserve.worker"):
        assert store.load(entry) is None
    assert skipped(caplog) == [reason]
    assert not path.exists() and store.stats().skipped == 1 and store._refresh() == []


def test_every_entry_is_written_through_to_disk_at_once_and_one_the_disk_cannot_take_is_still_told(
        tmp_path: Path) -> None:
    s = HostStore(KEY, {"model": "format"}, tmp_path / "ram", 1 << 24, tmp_path / "disk", 1 << 24)
    s.put([1, 2], bytearray(STATE), len(STATE), (12,))
    s.flush()
    assert (tmp_path / "disk" / KEY / address((1, 2))).read_bytes() == entry_file((1, 2), summary=(12,))
    s.close()
    small = HostStore(KEY, {"model": "format"}, tmp_path / "ram2", 1 << 24, tmp_path / "disk2", len(STATE) // 2)
    small.put([3], bytearray(STATE), len(STATE), (13,))
    small.flush()
    assert not list((tmp_path / "disk2").rglob("*.kv"))  # larger than the whole disk tier: RAM only ...
    assert [summary for _, summary in small.take_changes().added] == [(13,)]  # ... and told all the same
    small.close()


def test_writing_an_entry_again_makes_it_the_most_recently_used(tmp_path: Path) -> None:
    state = STATE * 16
    s = HostStore(KEY, {"model": "format"}, tmp_path / "ram", 2 * len(entry_file((1,), state)))  # room for two
    for tokens in ([1], [2], [1], [3]):  # 1 again: not written twice, but used last: 2 leaves for 3
        s.put(tokens, bytearray(state), len(state))
        s.flush()
    assert sorted(e.tokens for e in s._refresh()) == [(1,), (3,)]
    s.close()
