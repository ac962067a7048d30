"""The host store through real servers: what an instance computed outlives it (kill -9, unload and load, a
server restart from the RAM tier, a restart with a disk tier after the RAM tier is gone), two instances saving
one prefix at once write one entry, and a bad entry is skipped, removed and computed instead."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import signal
import struct
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ServerProcess
from engines import LONG_PROMPT as LONG
from helpers import running

from mpserve import Client
from mpserve.engine.host_store import MAGIC
from mpserve.engine.sequence import PROMPT_CHUNK
from mpserve.engine.store_format import PREFIX
from mpserve.wire.slots import SlotState

FOLLOW_UP = LONG + " and then the cat sat"
SERVER = ("--parallel", "1", "--n-ctx", "1024", "--cache-ram", "64MiB", "--reuse", "exact")  # whole chunks


def wait_for(check: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def entries(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.kv"))


def worker_pid(server: ServerProcess) -> int:
    rows = [r for r in server.slots() if r.state is SlotState.IDLE and r.pid > 0]
    return rows[0].pid if rows else 0


@pytest.mark.timeout(120)
def test_an_instance_killed_with_sigkill_is_replaced_by_one_that_restores_what_it_computed(
        start_server: type[ServerProcess], tmp_path: Path) -> None:
    store = tmp_path / "shm"
    server = start_server(*SERVER, "--cache-shm", str(store)).wait_ready()
    with Client(server.address, timeout=60) as client:
        assert client.generate(LONG, max_tokens=4, temperature=0).timings.cached_tokens == 0
        wait_for(lambda: entries(store), 10, "the prompt's entry in the store")
        killed = worker_pid(server)
        os.kill(killed, signal.SIGKILL)
        wait_for(lambda: worker_pid(server) not in (0, killed), 60, "the replacement instance")
        again = client.generate(FOLLOW_UP, max_tokens=4, temperature=0)
    assert again.timings.cached_tokens == PROMPT_CHUNK  # restored by the replacement
    assert server.slots()[0].cache.hits == 1
    assert not server.tracebacks(), "\n".join(server.log)


@pytest.mark.timeout(120)
def test_a_model_unloaded_and_loaded_again_restores_its_prompts(start_server: type[ServerProcess],
                                                                 tmp_path: Path) -> None:
    store = tmp_path / "shm"
    server = start_server(*SERVER, "--cache-shm", str(store)).wait_ready()
    with Client(server.address, timeout=60) as client, Client(server.admin) as admin:
        client.generate(LONG, max_tokens=4, temperature=0)
        pid = worker_pid(server)
        admin.control("unload", "tiny")
        wait_for(lambda: not running(pid), 30, "the instance to exit")
        assert entries(store)  # written before the instance went
        admin.control("load", "tiny")
        again = client.generate(FOLLOW_UP, max_tokens=4, temperature=0)
    assert again.timings.cached_tokens == PROMPT_CHUNK
    assert not server.tracebacks(), "\n".join(server.log)


@pytest.mark.timeout(120)
def test_an_instance_told_to_stop_keeps_what_its_slot_holds_generated_tokens_too(
        start_server: type[ServerProcess], tmp_path: Path) -> None:
    """An instance stopped (a scale-down, an unload) closes its engine before it exits: what its slot holds goes to
    the store, and the writes it queued are made (it used to exit with them, and its writer thread, cut short)."""
    store = tmp_path / "shm"
    server = start_server("--parallel", "1", "--n-ctx", "1024", "--cache-ram", "64MiB",
                          "--cache-shm", str(store)).wait_ready()  # reuse: any keeps cells of any length
    with Client(server.address, timeout=60) as client, Client(server.admin) as admin:
        done = client.generate(LONG, max_tokens=8, temperature=0, ignore_eos=True)
        pid = worker_pid(server)
        admin.control("unload", "tiny")
        wait_for(lambda: not running(pid), 30, "the instance to exit")
    held = {_tokens_in(entry) for entry in entries(store)}
    # all but the last token sampled (it has no cell), as the slot held them
    assert done.usage.prompt_tokens + done.usage.completion_tokens - 1 in held, held
    assert not server.tracebacks(), "\n".join(server.log)


def _tokens_in(entry: Path) -> int:
    """How many tokens a store entry's header says it holds the cells of."""
    data = entry.read_bytes()
    _, length, _ = PREFIX.unpack_from(data)
    return int(json.loads(data[PREFIX.size:PREFIX.size + length])["tokens"])


@pytest.mark.timeout(120)
def test_a_server_restarted_without_a_disk_tier_restores_from_the_ram_tier_it_left(
        start_server: type[ServerProcess], tmp_path: Path) -> None:
    store = tmp_path / "shm"  # a folder of files: it outlives every process, the server's too
    first = start_server(*SERVER, "--cache-shm", str(store)).wait_ready()
    with Client(first.address, timeout=60) as client:
        client.generate(LONG, max_tokens=4, temperature=0)
    wait_for(lambda: entries(store), 10, "the prompt's entry in the store")
    assert first.stop() == 0
    second = start_server(*SERVER, "--cache-shm", str(store)).wait_ready()
    with Client(second.address, timeout=60) as client:
        again = client.generate(FOLLOW_UP, max_tokens=4, temperature=0)
    assert again.timings.cached_tokens == PROMPT_CHUNK and second.slots()[0].cache.hits == 1


@pytest.mark.timeout(120)
def test_a_server_restarted_with_a_disk_tier_restores_after_its_ram_tier_is_gone(
        start_server: type[ServerProcess], tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    first = start_server(*SERVER, "--cache-shm", str(tmp_path / "shm1"), "--cache-disk", str(disk),
                         "--cache-disk-size", "64MiB").wait_ready()
    with Client(first.address, timeout=60) as client:
        client.generate(LONG, max_tokens=4, temperature=0)
    wait_for(lambda: entries(disk), 10, "the entry on disk")
    assert first.stop() == 0
    second = start_server(*SERVER, "--cache-shm", str(tmp_path / "shm2"), "--cache-disk", str(disk),
                          "--cache-disk-size", "64MiB").wait_ready()  # as after a reboot: an empty tmpfs
    with Client(second.address, timeout=60) as client:
        again = client.generate(FOLLOW_UP, max_tokens=4, temperature=0)
    assert again.timings.cached_tokens == PROMPT_CHUNK
    cache = second.slots()[0].cache
    assert cache.hits == 1 and 0 < cache.disk_bytes <= cache.disk_capacity == 64 << 20
    assert entries(tmp_path / "shm2")  # the hit was copied back into RAM


class Renames:
    """The names renamed into ``folder`` since this was made (Linux's inotify: IN_MOVED_TO, and IN_CREATE, whose
    events between two renames keep the kernel from merging those into one)."""

    IN_MOVED_TO, IN_CREATE, IN_NONBLOCK = 0x80, 0x100, 0o4000

    def __init__(self, folder: Path) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(self.IN_NONBLOCK)
        assert self._fd >= 0 and self._libc.inotify_add_watch(self._fd, os.fsencode(folder),
                                                                     self.IN_MOVED_TO | self.IN_CREATE) >= 0

    def into_place(self) -> list[str]:
        try:
            data = os.read(self._fd, 65536)
        except BlockingIOError:
            return []
        finally:
            os.close(self._fd)
        names, at = [], 0
        while at < len(data):  # struct inotify_event: wd, mask, cookie, len, then the name
            _, mask, _, length = struct.unpack_from("iIII", data, at)
            if mask & self.IN_MOVED_TO:
                names.append(data[at + 16:at + 16 + length].rstrip(b"\0").decode())
            at += 16 + length
        return names


@pytest.mark.timeout(120)
def test_two_instances_computing_one_prompt_at_once_write_one_entry_and_bad_entries_are_computed_instead(
        start_server: type[ServerProcess], tmp_path: Path) -> None:
    store = tmp_path / "shm"
    server = start_server(*SERVER, "--instances", "2", "--cache-shm", str(store)).wait_ready()
    (folder,) = [p for p in store.iterdir() if p.is_dir()]  # the model's compatibility key, made at load
    renames = Renames(folder)  # an entry is written under a temporary name and renamed into place
    results = []
    with Client(server.address, timeout=60) as client:
        def ask() -> None:
            with Client(server.address, timeout=60) as own:
                results.append(own.generate(LONG, max_tokens=4, temperature=0))

        instances = {r.pid for r in server.slots() if r.pid > 0}
        for pid in instances:  # neither can finish its request before the other has one: the broker, finding the
            os.kill(pid, signal.SIGSTOP)  # first instance's one slot taken, hands the second request to the other
        threads = [threading.Thread(target=ask) for _ in range(2)]
        for t in threads:
            t.start()
        wait_for(lambda: sorted(w.running for w in client.stats().workers) == [1, 1], 30, "a request on each")
        for pid in instances:
            os.kill(pid, signal.SIGCONT)
        for t in threads:
            t.join()
        assert len({r.worker for r in results}) == 2  # one each, at once
        wait_for(lambda: entries(store), 10, "the entry")
        time.sleep(0.5)  # not a wait: the second writer's turn, for a rename that must not come
        saved = entries(store)
        assert len(saved) == 1 and not list(store.rglob("*.kvpart"))
        assert renames.into_place() == [saved[0].name]  # written once: the second writer found it there
        saved[0].write_bytes(saved[0].read_bytes()[:1000])  # truncated (a reader never sees this from a writer)
        (saved[0].parent / ("0" * 32 + ".kv")).write_bytes(b"not an entry at all")
        for pid in {r.pid for r in server.slots() if r.pid > 0}:  # both instances lose their cells: the store
            os.kill(pid, signal.SIGKILL)  # is the only place left to restore from
        wait_for(lambda: sum(r.state is SlotState.IDLE for r in server.slots()) == 2, 60, "the replacements")
        again = client.generate(FOLLOW_UP, max_tokens=4, temperature=0)
    assert again.timings.cached_tokens == 0  # computed: nothing good to restore
    assert not (saved[0].parent / ("0" * 32 + ".kv")).exists()
    wait_for(lambda: saved[0].exists() and saved[0].stat().st_size > 1000, 10, "the prefix saved again, whole")
    wait_for(lambda: sum(r.cache.skipped for r in server.slots()) >= 2, 10,
             "both bad entries counted as skipped (the rows have it within a heartbeat)")
    assert any("skipped and removed: truncated" in line for line in server.log), "\n".join(server.log)
    assert not server.tracebacks(), "\n".join(server.log)


@pytest.mark.timeout(120)
def test_a_poisoned_entry_is_a_counted_miss_and_the_model_keeps_serving(start_server: type[ServerProcess],
                                                                       tmp_path: Path) -> None:
    store = tmp_path / "shm"
    server = start_server(*SERVER, "--cache-shm", str(store)).wait_ready()
    with Client(server.address, timeout=60) as client:
        client.generate(LONG, max_tokens=4, temperature=0)
        wait_for(lambda: entries(store), 10, "the prompt's entry in the store")
        key_folder = entries(store)[0].parent
        header = json.dumps({"key": key_folder.name, "tokens": 1, "state_bytes": 0, "summary": "abc"}).encode()
        body = header + struct.pack("<i", 1)
        poisoned = key_folder / (hashlib.sha256(key_folder.name.encode() + body[-4:]).hexdigest()[:32] + ".kv")
        poisoned.write_bytes(  # about 100 bytes, at the right address, that once made every worker exit at load
            MAGIC + struct.pack("<II", len(header), zlib.crc32(body)) + body)
        killed = worker_pid(server)
        os.kill(killed, signal.SIGKILL)  # its replacement reads the store's entries as it registers
        wait_for(lambda: worker_pid(server) not in (0, killed), 60, "the replacement instance")
        assert client.generate(FOLLOW_UP, max_tokens=4, temperature=0).timings.cached_tokens == PROMPT_CHUNK
    assert not poisoned.exists()
    wait_for(lambda: sum(r.cache.skipped for r in server.slots()) == 1, 10, "the bad entry counted as skipped")
    assert any("skipped and removed: its summary is not" in line for line in server.log), "\n".join(server.log)
    assert [p.name for p in store.iterdir() if p.is_dir()] == [key_folder.name]  # no digest cache in it
    assert not server.tracebacks(), "\n".join(server.log)
