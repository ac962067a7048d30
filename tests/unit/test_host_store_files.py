"""The host store on real files and real processes: least recently used out first, by bytes, never over its
sizes (with several writers, and one killed halfway); RAM entries spill to disk; bad entries are skipped and
removed; what the broker hears of."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import multiprocessing
import os
import signal
import stat
import struct
import time
import zlib
from pathlib import Path

import pytest
from helpers import as_other_user, shared_place

from mpserve.config import loader as cfg
from mpserve.engine import host_store
from mpserve.engine.host_store import HostStore, compatibility_key
from mpserve.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

KEY = compatibility_key({"model": "test"})
STATE = 4000  # bytes of each test state


def state(fill: int) -> bytearray:
    return bytearray([fill % 256]) * STATE


def store(tmp: Path, ram: int, disk: int = 0, key: str = KEY) -> HostStore:
    return HostStore(key, {"model": "test"}, tmp / "ram", ram, tmp / "disk" if disk else None, disk)


def put(s: HostStore, tokens: list[int], fill: int = 1, summary: tuple[int, ...] = ()) -> None:
    s.put(tokens, state(fill), STATE, summary)


def flush(s: HostStore) -> None:
    s.flush()


def tier_bytes(folder: Path) -> int:
    """The bytes of the entries and partial writes in ``folder`` now (a file another process removes between
    the listing and its stat counts for nothing)."""
    total = 0
    for f in folder.rglob("*"):
        if f.name.endswith((".kv", ".kvpart")):
            with contextlib.suppress(FileNotFoundError):
                total += f.stat().st_size
    return total


def test_the_least_recently_used_entries_leave_first_and_the_tier_never_exceeds_its_size(tmp_path: Path) -> None:
    s = store(tmp_path, ram=3 * STATE)  # room for two entries with their headers
    for first in range(1, 6):
        put(s, [first, 0, 0], first)
        flush(s)
        assert tier_bytes(tmp_path / "ram") <= 3 * STATE
    assert {e.tokens for e in s._refresh()} == {(4, 0, 0), (5, 0, 0)}
    entry, shared = s.find([4, 0, 0, 9])
    assert entry is not None and shared == 3
    loaded = s.load(entry)  # a hit: 4 is the most recently used now
    assert loaded is not None and bytes(loaded[0]) == bytes(state(4)) and loaded[1] == STATE
    time.sleep(0.01)  # not a wait: a later access time than the entry's
    put(s, [6, 0], 6)
    flush(s)
    assert {e.tokens for e in s._refresh()} == {(4, 0, 0), (6, 0)}
    assert s.stats().evictions == 4 and s.stats().bytes <= 3 * STATE
    s.close()


def test_entries_pushed_out_of_ram_go_to_disk_and_come_back_from_there(tmp_path: Path) -> None:
    s = store(tmp_path, ram=2 * STATE, disk=3 * STATE)
    for first in range(1, 6):
        put(s, [first, 7], first)
        flush(s)
        assert tier_bytes(tmp_path / "ram") <= 2 * STATE and tier_bytes(tmp_path / "disk") <= 3 * STATE
    stats = s.stats()  # every entry is written through to disk: RAM holds the last, disk the last two
    assert stats.disk_capacity == 3 * STATE and 0 < stats.disk_bytes <= 3 * STATE and stats.evictions == 3
    entry, _ = s.find([4, 7, 1])
    assert entry is not None and (tmp_path / "disk" / KEY / entry.name).exists()
    assert not (tmp_path / "ram" / KEY / entry.name).exists()
    loaded = s.load(entry)
    assert loaded is not None and bytes(loaded[0]) == bytes(state(4))
    assert (tmp_path / "ram" / KEY / entry.name).exists()  # copied back up: the most recently used
    assert s.find([1, 7])[0] is None  # out of both tiers
    s.close()
    again = store(tmp_path / "rebooted", ram=2 * STATE)  # a new process with an empty RAM tier (a reboot) ...
    again.close()
    again = HostStore(KEY, {"model": "test"}, tmp_path / "rebooted", 2 * STATE, tmp_path / "disk", 3 * STATE)
    assert again.find([5, 7])[1] == 2  # ... finds the disk tier's entries
    again.close()


def test_a_longer_entry_replaces_its_prefixes_and_a_prefix_of_an_entry_adds_nothing(tmp_path: Path) -> None:
    s = store(tmp_path, ram=10 * STATE)
    put(s, [1, 2, 3])
    flush(s)
    assert s.holds([1, 2]) and s.holds([1, 2, 3]) and not s.holds([1, 2, 3, 4])
    put(s, [1, 2, 3, 4, 5], summary=(51, 52))
    flush(s)
    assert [e.tokens for e in s._refresh()] == [(1, 2, 3, 4, 5)]
    s.close()


def test_where_states_are_not_cut_back_an_entry_serves_only_prompts_that_extend_all_its_tokens(tmp_path: Path) -> None:
    """A sliding-window or recurrent model's state restores only whole: a longer entry keeps its prefixes, and a
    prompt gets the longest entry that is all prefix of it, not a longer one it shares more with."""
    s = HostStore(KEY, {"model": "test"}, tmp_path / "ram", 10 * STATE, cut_back=False)
    put(s, [1, 2])
    put(s, [1, 2, 3, 4, 5])
    flush(s)
    assert sorted(e.tokens for e in s._refresh()) == [(1, 2), (1, 2, 3, 4, 5)]  # the shorter one stays
    assert s.holds([1, 2]) and s.holds([1, 2, 3, 4, 5]) and not s.holds([1, 2, 3])
    entry, shared = s.find([1, 2, 3, 9])
    assert entry is not None and entry.tokens == (1, 2) and shared == 2
    entry, shared = s.find([1, 2, 3, 4, 5, 6])
    assert entry is not None and shared == 5
    assert s.find([1, 9]) == (None, 0)
    s.close()


def test_a_live_entry_replaces_its_sequences_last_stays_in_ram_is_told_to_no_one_and_goes_when_forgotten(
        tmp_path: Path) -> None:
    """``put_live`` (a generating sequence's cells, ``mpserve.engine.live``), on a store that keeps shorter prompt
    entries (not cut back): each replaces the last of its salt, none reaches the disk tier, the broker's changes or
    the KV events, a prompt entry of another salt is left alone, and ``forget_live`` removes what the tokens extend."""
    s = HostStore(KEY, {"model": "test"}, tmp_path / "ram", 10 * STATE, tmp_path / "disk", 10 * STATE, cut_back=False)
    s.take_kv_log()  # the KV events' log starts
    live, other = b"L" * 16, b"M" * 16
    s.put([1, 2], state(1), STATE, (7,))  # a prompt entry of the default salt
    for n in (3, 4, 5):
        assert s.put_live(list(range(1, n + 1)), state(n), STATE, live, wait=True)
    assert s.put_live([1, 2, 9], state(9), STATE, other, wait=True)  # another sequence of the same prompt
    flush(s)
    assert sorted((e.salt, e.tokens) for e in s._refresh()) == [
        (b"", (1, 2)), (live, (1, 2, 3, 4, 5)), (other, (1, 2, 9))]
    assert [p.name for p in (tmp_path / "disk").rglob("*.kv")] == [s.find([1, 2], b"")[0].name]  # type: ignore
    assert [tokens for _, tokens, _ in s.take_kv_log()] == [(1, 2)]
    assert [i for i, _ in s.take_changes().added] == [s.find([1, 2], b"")[0].id]  # type: ignore[union-attr]
    s.forget_live([1, 2, 3, 4, 5, 6, 7], live)
    flush(s)
    assert sorted((e.salt, e.tokens) for e in s._refresh()) == [(b"", (1, 2)), (other, (1, 2, 9))]
    s.close()


def test_a_flush_with_a_timeout_says_whether_the_writes_were_made_and_a_live_put_does_not_wait_past_its_bound(
        tmp_path: Path) -> None:
    """A leaving instance waits a bounded time for its live saves (``mpserve.engine.live.LEAVING_S``): while
    another process holds the tier's lock, the writer cannot write, a flush with a timeout says so and a live put
    with a bound gives up; once the lock is free the writes are made."""
    s = store(tmp_path, ram=10 * STATE)
    lock = os.open(tmp_path / "ram" / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # as another instance writing would
    try:
        for n in range(5):  # the writer takes the first and blocks on the lock; four wait in its queue
            assert s.put_live(list(range(n + 3)), state(n), STATE, b"L" * 16, wait=1.0)
        assert not s.put_live(list(range(9)), state(9), STATE, b"L" * 16, wait=0.2)
        assert not s.flush(0.2)
    finally:
        os.close(lock)  # the lock goes with the descriptor
    assert s.flush(10)
    assert [e.tokens for e in s._refresh()] == [tuple(range(7))]  # each live entry replaced the last
    s.close()


def test_truncated_foreign_and_corrupt_entries_are_skipped_and_removed(tmp_path: Path) -> None:
    s = store(tmp_path, ram=10 * STATE)
    for first in (1, 2, 3):
        put(s, [first, 9], first)
    flush(s)
    names = {e.tokens[0]: tmp_path / "ram" / KEY / e.name for e in s._refresh()}
    data = names[1].read_bytes()
    names[1].write_bytes(data[:len(data) // 2])  # truncated
    flipped = bytearray(names[2].read_bytes())
    flipped[-10] ^= 0xFF  # a flipped bit in the state: the CRC catches it
    names[2].write_bytes(bytes(flipped))
    other = store(tmp_path, ram=10 * STATE, key=compatibility_key({"model": "other"}))
    put(other, [3, 9], 3)  # the same tokens under another key, copied into ours: foreign
    flush(other)
    foreign = other._refresh()[0]
    names[3].write_bytes((tmp_path / "ram" / other.key / foreign.name).read_bytes())
    fresh = store(tmp_path, ram=10 * STATE)  # another instance, whose index reads the headers afresh
    for first in (1, 2, 3):
        entry, _ = fresh.find([first, 9])
        assert entry is None or fresh.load(entry) is None
        assert not names[first].exists()
    assert fresh.stats().skipped == 3
    for s_ in (s, other, fresh):
        s_.close()


def _writer(root: str, first: int, count: int) -> None:
    s = HostStore(KEY, {"model": "test"}, Path(root), 5 * STATE)
    for i in range(count):
        s.put([first + i, 1, 2], state(i), STATE)
    s.close()


def test_writers_in_several_processes_share_one_size_and_write_one_entry_per_prefix(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path / "ram"), first, 12)) for first in (0, 0, 100, 200)]
    for p in procs:
        p.start()
    seen = 0
    while any(p.is_alive() for p in procs):
        seen = max(seen, tier_bytes(tmp_path / "ram"))
        time.sleep(0.002)
    assert all(p.exitcode == 0 for p in procs)
    assert seen <= 5 * STATE and tier_bytes(tmp_path / "ram") <= 5 * STATE
    s = store(tmp_path, ram=5 * STATE)
    held = [e.tokens for e in s._refresh()]
    assert len(held) == len(set(held)) and len(held) >= 1
    s.close()


def _killed_while_writing(root: str) -> None:
    """Holds the lock, writes half an entry, and is SIGKILLed there."""
    s = HostStore(KEY, {"model": "test"}, Path(root), 5 * STATE)
    with s._tiers[0].lock():
        (Path(root) / KEY / f".tmp-{os.getpid()}-1.kvpart").write_bytes(b"x" * 3 * STATE)
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_writer_killed_halfway_leaves_nothing_that_counts_against_the_size(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=_killed_while_writing, args=(str(tmp_path / "ram"),))
    p.start()
    p.join()
    assert p.exitcode == -signal.SIGKILL
    s = store(tmp_path, ram=5 * STATE)  # the lock was released by the kernel: this write does not wait forever
    for first in range(4):
        put(s, [first, 5], first)
    flush(s)
    assert not list((tmp_path / "ram").rglob("*.kvpart"))
    assert len(s._refresh()) == 4 and tier_bytes(tmp_path / "ram") <= 5 * STATE
    s.close()


def test_the_entries_with_a_summary_are_told_once_with_one_id_for_every_instance(tmp_path: Path) -> None:
    s = store(tmp_path, ram=3 * STATE)
    put(s, [1, 0], 1, summary=(11, 12))
    put(s, [2, 0], 2)  # no summary (a prompt of token ids): nothing to tell
    flush(s)
    changes = s.take_changes()
    assert [summary for _, summary in changes.added] == [(11, 12)] and not changes.dropped
    assert not s.take_changes()  # told once
    other = store(tmp_path, ram=3 * STATE)
    assert other.snapshot(10, 100).added == changes.added  # the same id: the broker's view is per host
    put(s, [3, 0], 3, summary=(31,))  # evicts 1
    flush(s)
    assert s.take_changes().dropped == (changes.added[0][0],)
    for s_ in (s, other):
        s_.close()


FULL_DISK = """
import logging, sys
from pathlib import Path
from mpserve.engine.host_store import HostStore
logging.basicConfig(level=logging.WARNING)
disk = Path(sys.argv[1])
s = HostStore(sys.argv[2], {}, Path(sys.argv[3]), 1 << 20, disk, 1 << 20)  # the disk tier's size says yes ...
for first in range(3):
    s.put([first, 1], bytearray(40000), 40000)  # ... its file system (64 KiB) has room for one entry
s.close()
stats = s.stats()
ram = Path(sys.argv[3])
print("skipped", stats.skipped, "ram", len(list(ram.rglob("*.kv"))), "disk", len(list(disk.rglob("*.kv"))))
"""


def test_a_full_disk_is_a_logged_skip_and_ram_still_takes_the_entries(tmp_path: Path) -> None:
    """A real ENOSPC: the disk tier on a 64 KiB tmpfs, mounted in a user and mount namespace of its own."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("unshare -rm (user namespaces) is not available: no small file system to fill")
    disk, program = tmp_path / "disk", tmp_path / "fill.py"
    disk.mkdir()
    program.write_text(FULL_DISK)
    script = (f"mount -t tmpfs -o size=64k,mode=700 none {disk} && "
              f"exec {sys.executable} {program} {disk} {KEY} {tmp_path / 'ram'}")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["skipped", "2", "ram", "3", "disk", "1"], proc.stdout + proc.stderr
    assert "the tier's file system is full" in proc.stderr and "Traceback" not in proc.stderr


def raw_entry(header: object, tail: bytes = b"") -> bytes:
    """An entry file as a writer lays it out, with any header (a JSON value, or raw bytes) and what follows it."""
    body = (header if isinstance(header, bytes) else json.dumps(header).encode()) + tail
    return host_store.MAGIC + struct.pack("<II", len(body) - len(tail), zlib.crc32(body)) + body


MALFORMED = {
    "huge token count": {"key": KEY, "tokens": 10**15, "state_bytes": 4, "summary": []},
    "negative token count": {"key": KEY, "tokens": -3, "state_bytes": 4, "summary": []},
    "a token count that is text": {"key": KEY, "tokens": "2", "state_bytes": 4, "summary": []},
    "a state too long for the file": {"key": KEY, "tokens": 1, "state_bytes": 1 << 40, "summary": []},
    "a summary that is text": {"key": KEY, "tokens": 1, "state_bytes": 4, "summary": "abc"},
    "a summary past 64 bits": {"key": KEY, "tokens": 1, "state_bytes": 4, "summary": [1 << 70]},
    "a summary of floats": {"key": KEY, "tokens": 1, "state_bytes": 4, "summary": [1.5]},
    "a header that is a list": [KEY, 1, 4],
    "a header nested past the parser": b"[" * 100_000,
    "a header that is not UTF-8": b"\xff\xfe{}",
}


def test_malformed_entries_and_planted_files_are_counted_misses_that_are_removed_never_an_exception(
        tmp_path: Path) -> None:
    s = store(tmp_path, ram=1 << 20)
    put(s, [5, 6], 5, summary=(56,))
    flush(s)
    folder = tmp_path / "ram" / KEY
    planted = []
    for i, header in enumerate(MALFORMED.values()):
        planted.append(folder / f"{i:032x}.kv")
        planted[-1].write_bytes(raw_entry(header, struct.pack("<i", 7) + b"\0" * 4))
    victim = tmp_path / "victim"
    victim.write_bytes(raw_entry({"key": KEY, "tokens": 1, "state_bytes": 0}, struct.pack("<i", 7)))
    planted.append(folder / f"{len(planted):032x}.kv")
    planted[-1].symlink_to(victim)  # never read through, never the victim removed
    planted.append(folder / f"{len(planted):032x}.kv")
    os.mkfifo(planted[-1])  # a reader that opened it would wait for ever
    fresh = store(tmp_path, ram=1 << 20)  # another instance, whose index reads every header afresh
    assert fresh.snapshot(10, 100).added[0][1] == (56,)  # what a registering worker asks: the good entry only
    entry, shared = fresh.find([5, 6, 7])
    assert entry is not None and shared == 2 and fresh.load(entry) is not None
    assert [p.name for p in planted if os.path.lexists(p)] == []
    assert fresh.stats().skipped == len(planted) and victim.exists()
    for s_ in (s, fresh):
        s_.close()


def test_the_stores_folders_and_files_are_closed_to_other_users(tmp_path: Path) -> None:
    s = HostStore(KEY, {"model": "test"}, tmp_path / "ram", 1 << 20, tmp_path / "disk", 1 << 20)
    put(s, [1, 2], 1)
    flush(s)
    s.close()
    for tier in ("ram", "disk"):
        root = tmp_path / tier
        folders = [root, *[p for p in root.rglob("*") if p.is_dir()]]
        files = [p for p in root.rglob("*") if p.is_file()]
        assert {stat.S_IMODE(p.stat().st_mode) for p in folders} == {0o700}
        assert {p.name.rsplit(".", 1)[-1] for p in files} == {"kv", "json", "lock"}  # lock, identity, the entry
        assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o600}
    tmp_path.chmod(0o755)  # the test's own folder opened, as /dev/shm is: the store's folders still refuse
    entry = next((tmp_path / "ram").rglob("*.kv"))
    assert as_other_user(lambda: os.listdir(tmp_path / "ram")).startswith("PermissionError")
    assert as_other_user(lambda: entry.read_bytes()).startswith("PermissionError")


@pytest.mark.parametrize("made", ["by another user", "open to others", "a link another user planted"])
def test_a_store_folder_that_is_not_ours_alone_is_refused_naming_it_and_the_fix(made: str) -> None:
    with shared_place() as shared:
        folder = shared / "mpserve-store-0"  # a predictable name, made before the server starts
        if made == "open to others":
            folder.mkdir(mode=0o755)
            folder.chmod(0o755)
            fix = "close it with: chmod 700"
        elif made == "by another user":
            assert as_other_user(lambda: folder.mkdir(mode=0o777)) == "ok"
            fix = "belongs to user 65534.*remove it"
        else:
            theirs = shared / "theirs"
            assert as_other_user(lambda: (theirs.mkdir(mode=0o777), folder.symlink_to(theirs))) == "ok"
            fix = "is a symbolic link; remove it"
        refused = f"host store's ram tier folder {folder} .*{fix}"
        with pytest.raises(ConfigError, match=refused):
            store_at(folder)
        with pytest.raises(ConfigError, match=f"models\\[0\\].cache_shm: the {refused}"):
            cfg.build({"models": [{"cache_shm": str(folder)}]})
        assert list(Path(os.path.realpath(folder)).iterdir()) == []  # nothing written into it


def store_at(ram: Path) -> HostStore:
    return HostStore(KEY, {"model": "test"}, ram, 1 << 20)


def test_the_models_digest_is_noted_in_a_private_folder_and_a_bad_note_is_never_believed(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(1000))
    right = hashlib.sha256(model.read_bytes()).hexdigest()
    notes = tmp_path / "digests"
    assert host_store.gguf_digest(str(model), notes) == right
    [note] = notes.iterdir()
    assert stat.S_IMODE(notes.stat().st_mode) == 0o700 and stat.S_IMODE(note.stat().st_mode) == 0o600
    note.write_text("0" * 64)
    os.chmod(notes, 0o777)  # anyone could have written that note: the folder is refused, the digest computed
    assert host_store.gguf_digest(str(model), notes) == right
    os.chmod(notes, 0o700)
    note.unlink()
    note.symlink_to(tmp_path / "elsewhere")  # a link is not followed, to read or to write
    (tmp_path / "elsewhere").write_text("1" * 64)
    assert host_store.gguf_digest(str(model), notes) == right
    assert (tmp_path / "elsewhere").read_text() == "1" * 64
