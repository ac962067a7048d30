"""The host store's remote tier on a real Redis (Debian's redis-server, private to this module: its own port and
folder, nothing saved): two servers with their own runtime folders and host stores stand for two hosts sharing it.

A prompt computed on the first is restored on the second; a forged or corrupt entry in Redis is a counted miss and
the output is the same; Redis killed mid-run fails no request (the errors counter rises, the local tiers serve), and
reuse comes back when Redis is back on its port.
"""

from __future__ import annotations

import ctypes
import json
import shutil
import struct
import subprocess
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from conftest import ServerProcess
from gateway_thread import GatewayThread
from helpers import free_port, mpserve, wait_for

from mpserve import Client
from mpserve.config.remote_tier import RemoteTier
from mpserve.engine import remote_store
from mpserve.engine.host_store import MAGIC, HostStore
from mpserve.engine.sequence import PROMPT_CHUNK
from mpserve.runtime import ServerInfo
from mpserve.wire.slots import CacheRow

pytestmark = pytest.mark.timeout(180)

REDIS_SERVER = "/usr/bin/redis-server"  # tests/run installs Debian's redis-server where missing
RESTORED = 3 * PROMPT_CHUNK  # a prompt of 1,537 to 2,048 tokens is saved at its last whole chunk


def prompt(tag: str) -> str:
    """About 2,000 tokens of the tiny model, different from the other tags' from the first token."""
    return f"{tag} " + " ".join(f"the {w} of all and" for w in ("cat", "dog", "sea", "sky") * 64)


class Redis:
    """A private redis-server on ``port``, in ``folder``: nothing saved, stopped and started again on the same
    port."""

    def __init__(self, folder: Path, port: int) -> None:
        self.folder, self.port, self.proc = folder, port, None
        self.client = redis.Redis(port=port, socket_timeout=5)

    def start(self) -> None:
        self.proc = subprocess.Popen([REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.folder)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self._answers, 10, "redis-server to answer", interval=0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def _answers(self) -> bool:
        try:
            return bool(self.client.ping())
        except redis.ConnectionError:
            return False

    def entries(self) -> list[bytes]:
        return sorted(self.client.keys("mpserve:*:kv:*"))


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Redis]:
    if not shutil.which(REDIS_SERVER):
        pytest.fail(f"{REDIS_SERVER} is missing: tests/run installs it (apt-get install redis-server)")
    server = Redis(tmp_path_factory.mktemp("redis"), free_port())
    server.start()
    yield server
    server.kill()


class Host(ServerProcess):
    """A server with a runtime folder of its own, as a host has."""

    def __init__(self, home: Path, *args: str) -> None:
        self.run_dir = home / "run"
        self.run_dir.mkdir(mode=0o700)
        super().__init__(*args, env={"MPSERVE_RUNTIME_DIR": str(self.run_dir)})

    @property
    def info(self) -> ServerInfo:
        return ServerInfo(**json.loads((self.run_dir / f"{self.name}.json").read_text()))


@pytest.fixture(scope="module")
def hosts(redis_server: Redis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Host, ...]]:
    """Two servers, each with its runtime folder and host store, and the Redis as their remote tier."""
    started = []
    for name in ("a", "b"):
        home = tmp_path_factory.mktemp(f"host-{name}")
        started.append(Host(home, "--parallel", "1", "--n-ctx", "2560", "--reuse", "exact", "--cache-ram", "256MiB",
                            "--cache-shm", str(home / "store"),
                            "--cache-remote", f"redis://127.0.0.1:{redis_server.port}/0"))
    yield tuple(server.wait_ready() for server in started)
    for server in started:
        assert not server.tracebacks(), "\n".join(server.log)
        server.stop()


def run(server: ServerProcess, text: str) -> tuple[str, int]:
    """Greedy text and cached tokens of ``text`` on ``server``."""
    with Client(server.address, timeout=60) as client:
        result = client.generate(text, max_tokens=8, temperature=0)
    return result.text, result.timings.cached_tokens


def cache(server: ServerProcess) -> CacheRow:
    return server.slots()[0].cache


def test_a_prompt_computed_on_one_host_is_restored_on_the_other(hosts: tuple[Host, ...],
                                                               redis_server: Redis) -> None:
    a, b = hosts
    text, cached = run(a, prompt("first"))
    assert cached == 0
    wait_for(redis_server.entries, 10, "the entry in Redis")
    before = cache(b)  # the module's other tests may have used host b already
    again, restored = run(b, prompt("first"))
    assert restored >= RESTORED and again == text  # reuse: exact, so the output is the one computed
    after = cache(b)
    assert (after.remote_hits - before.remote_hits, after.hits - before.hits) == (1, 1)
    assert (after.remote_misses, after.remote_errors) == (before.remote_misses, before.remote_errors)
    status = mpserve("status", "--server-name", b.name, env={"MPSERVE_RUNTIME_DIR": str(b.run_dir)})
    line = (f"remote tier: {after.remote_hits} hits, {after.remote_misses} misses, {after.remote_errors} errors, "
            f"{after.remote_dropped} writes dropped")
    assert line in status.stdout, status.stdout


def _flip_a_state_byte(entry: bytearray) -> bytes:
    entry[-1] ^= 0xFF
    return bytes(entry)


def _other_tokens(entry: bytearray) -> bytes:
    """The entry with its first token changed and its CRC made right again: whole, but not the prompt's."""
    header = struct.unpack_from("<8sII", entry)[1]
    start = 16 + header
    struct.pack_into("<i", entry, start, struct.unpack_from("<i", entry, start)[0] + 1)
    struct.pack_into("<8sII", entry, 0, MAGIC, header, zlib.crc32(memoryview(entry)[16:]))
    return bytes(entry)


@pytest.mark.parametrize("forge", [_flip_a_state_byte, _other_tokens])
def test_a_forged_or_corrupt_entry_is_a_counted_miss_and_changes_no_output(
        hosts: tuple[ServerProcess, ...], redis_server: Redis, forge: Callable[[bytearray], bytes]) -> None:
    a, b = hosts
    before = set(redis_server.entries())
    text, _ = run(a, prompt(forge.__name__))
    wait_for(lambda: set(redis_server.entries()) - before, 10, "the entry in Redis")
    [key] = set(redis_server.entries()) - before
    forged = forge(bytearray(redis_server.client.get(key) or b""))
    redis_server.client.set(key, forged)
    misses = cache(b).remote_misses
    again, restored = run(b, prompt(forge.__name__))
    assert (again, restored) == (text, 0)  # computed: the entry was not trusted
    assert cache(b).remote_misses == misses + 1
    # deleted, and the entry the second host computed written in its place
    wait_for(lambda: redis_server.client.get(key) not in (None, forged), 10, "an honest entry under the key")


def test_redis_killed_mid_run_fails_no_request_and_reuse_comes_back_with_it(
        hosts: tuple[Host, ...], redis_server: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = hosts
    errors = cache(b).remote_errors
    redis_server.kill()
    for tag in ("down-1", "down-2"):
        run(b, prompt(tag))  # no request fails
    _, local = run(b, prompt("down-1") + " and more")
    assert local >= RESTORED  # the local tiers serve meanwhile
    assert cache(b).remote_errors > errors
    monkeypatch.setenv("MPSERVE_RUNTIME_DIR", str(b.run_dir))  # the gateway finds the second host's server
    gateway = GatewayThread(server_name=b.name)
    try:
        metrics = gateway.metrics()
    finally:
        gateway.stop()
    assert metrics[("mpserve_host_store_remote_errors_total", (("model", "tiny"), ("worker", "0")))] > errors
    assert sum("the remote store" in line and "failed" in line for line in b.log) == 1  # warned once
    redis_server.start()
    tries = iter(range(100))

    def reused() -> bool:
        """A new prompt computed on the first host, then asked of the second once Redis holds an entry (a write
        made while the first still kept the tier aside was dropped: the next prompt's is not)."""
        tag = f"back-{next(tries)}"
        run(a, prompt(tag))
        try:
            wait_for(redis_server.entries, 5, "the entry in Redis", interval=0.05)
        except AssertionError:
            return False
        return run(b, prompt(tag))[1] >= RESTORED

    wait_for(reused, 60, "a prompt computed on one host to be restored on the other again")
    assert any("answers again" in line for line in b.log)


def store(redis_server: Redis, folder: Path, user: str = "") -> HostStore:
    """A host store of its own (``folder``) over the module's Redis, as ``user`` if given."""
    url = f"redis://{user + '@' if user else ''}127.0.0.1:{redis_server.port}/0"
    tier = RemoteTier(url, 60, 1 << 20, password_file=str(folder / "password") if user else None)
    return HostStore("k" * 24, {}, folder / "ram", 16 << 20, remote=tier)


def put(host: HostStore, tokens: list[int]) -> None:
    state = (ctypes.c_uint8 * 4096)()
    host.put(tokens, state, len(state))


def test_an_acl_user_with_a_password_file_shares_entries_and_a_wrong_password_is_an_error_not_a_failure(
        redis_server: Redis, tmp_path: Path) -> None:
    redis_server.client.acl_setuser("mpserve", enabled=True, passwords=["+s3cret"], keys=["mpserve:*"],
                                    commands=["+@all"])
    for name, password in (("a", "s3cret"), ("b", "s3cret"), ("c", "wrong")):
        (tmp_path / name).mkdir(mode=0o700)
        (tmp_path / name / "password").write_text(password + "\n")
        (tmp_path / name / "password").chmod(0o600)
    a, b, c = (store(redis_server, tmp_path / name, "mpserve") for name in "abc")
    tokens = list(range(1000, 1200))
    put(a, tokens)
    wait_for(lambda: b.find(tokens)[1] == len(tokens), 10, "the entry, through the ACL user")
    assert c.find(tokens) == (None, 0) and c.stats().remote.errors == 1  # refused: counted, and a miss
    for host in (a, b, c):
        host.close()


def test_writes_never_wait_for_redis_those_past_the_queue_are_dropped_and_counted(
        redis_server: Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote_store, "IO_TIMEOUT_S", 60.0)  # a sender stuck on Redis for the whole test
    host = store(redis_server, tmp_path)
    before = len(redis_server.entries())
    redis_server.client.execute_command("CLIENT", "PAUSE", "60000", "WRITE")  # reads answer, writes wait
    try:
        for first in range(20):
            put(host, list(range(first, first + 100)))
        host.flush()  # every local write made, each offered to the remote tier while its sender is stuck
        stats = host.stats().remote
        assert stats.errors == 0  # the sender still waits on its first write: nothing above waited for it
        # the one being sent (once the sender took it), the queue's, the rest dropped
        assert 20 - 1 - remote_store.REMOTE_PENDING <= stats.dropped <= 20 - remote_store.REMOTE_PENDING
    finally:
        redis_server.client.execute_command("CLIENT", "UNPAUSE")
    host.close()  # the queued writes are made now
    assert len(redis_server.entries()) - before == 20 - stats.dropped
