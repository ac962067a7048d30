"""The host store's remote tier: entries shared by hosts through Redis 7 or Valkey 8 (``mpserve.engine.host_store``
writes into it and reads from it; ``mpserve.config.remote_tier`` is its setting).

    HostStore writer thread ─offer(tokens, salt, entry)─▶ queue (REMOTE_PENDING) ─▶ sender thread ─▶ SET entry EX ttl
                               full, or Redis down: dropped and counted                            ZADD index length
    HostStore.find ─fetch(tokens, salt, longer_than, check)─▶ ZREVRANGEBYSCORE index: the longest lengths that fit
                   ◀─ (name, entry) that ``check`` accepted ◀── GETRANGE entry (at most entry_bytes) ◀──┘
                      or None: a miss (a bad entry is deleted, and is a miss too)

An entry is the host store's entry file, byte for byte, under ``mpserve:KEY:kv:ADDRESS``: KEY is the store's
compatibility key (the GGUF's digest, the KV types, llama.cpp's version: ``host_store.compatibility_key``) and
ADDRESS the entry's content address (a digest of KEY, the tenant's salt and the tokens). So only an instance that
could restore an entry finds it, a tenant finds only entries of its own salt, and the host store checks what it
reads as it checks its own files (magic, key, counts, CRC, address) and compares the tokens with the prompt's:
a forged or damaged entry is a miss, never a changed output.

Finding an entry needs no listing: a prompt's entries are those whose tokens are a prefix of it, and their lengths
are kept in a sorted set per KEY, salt and first HEAD_TOKENS tokens (``mpserve:KEY:ix:SALT:HEAD``). The longest
lengths that fit are read, and the address of the prompt's prefix of that length names the entry, which holds
those very tokens or is a miss. This is LMCache's way of keying its Redis entries (a key per model and token-chunk
hash) with mpserve's entries, which hold a whole prefix's state rather than one chunk's.

Down or slow: every call has short socket timeouts, and is made again only where the connection was lost (Redis
restarted: the pool's connections are dead, a new one answers), not where it timed out. A failure is counted,
warned of once (until a call succeeds again, which is logged too) and keeps the tier aside for RETRY_S: lookups are
misses and writes are dropped meanwhile, without waiting; then the next call tries again. Writes never wait: the
engine's thread never sends, and a write that finds the queue full is dropped and counted.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import cast

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from mpserve.config.remote_tier import PASSWORD_ENV, RemoteTier, read_password

from .store_stats import RemoteStats

log = logging.getLogger("mpserve.worker")

REMOTE_PENDING = 8  # entries waiting for the sender thread; one more is dropped
HEAD_TOKENS = 64  # the tokens an entry's index is keyed by; shorter entries are not shared
CANDIDATES = 4  # lengths read from an index per lookup, longest first
CONNECT_TIMEOUT_S = 0.25
IO_TIMEOUT_S = 0.5
RETRY_S = 2.0  # a failed call keeps the tier aside this long


class RemoteStore:
    def __init__(self, tier: RemoteTier, key: str, address: Callable[[Sequence[int], bytes], str]) -> None:
        """``address``: an entry's content address from its tokens and salt (``host_store``'s)."""
        self._tier, self._key, self._address = tier, key, address
        self._client = redis.Redis.from_url(
            tier.url, password=_password(tier), socket_connect_timeout=CONNECT_TIMEOUT_S,
            socket_timeout=IO_TIMEOUT_S, retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)))
        self._counts = {"hits": 0, "misses": 0, "errors": 0, "dropped": 0}
        self._lock = threading.Lock()  # the counts and the state below, shared by the engine's and the sender thread
        self._aside_until, self._down = 0.0, False
        self._jobs: queue.Queue[tuple[tuple[int, ...], bytes, bytes | bytearray] | None] = queue.Queue(REMOTE_PENDING)
        self._sender = threading.Thread(target=self._send_loop, name="remote-store-sender", daemon=True)
        self._sender.start()

    # --- writing -------------------------------------------------------------------------------------------------

    def offer(self, tokens: tuple[int, ...], salt: bytes, entry: bytes | bytearray) -> None:
        """Queue ``entry`` (a host store entry file, no longer changed by its writer) for the sender thread; dropped
        and counted if the queue is full or the tier is aside. Never waits."""
        if len(tokens) < HEAD_TOKENS or len(entry) > self._tier.entry_bytes:
            return
        if not self._usable():
            self._count("dropped")
            return
        try:
            self._jobs.put_nowait((tokens, salt, entry))
        except queue.Full:
            self._count("dropped")

    def _send_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            tokens, salt, entry = job
            if not self._usable():
                self._count("dropped")
                continue
            name, index = self._entry_key(tokens, salt), self._index_key(tokens, salt)
            try:
                with self._client.pipeline(transaction=False) as pipe:
                    pipe.set(name, bytes(entry), ex=self._tier.ttl_s)
                    pipe.zadd(index, {str(len(tokens)): len(tokens)})
                    pipe.expire(index, self._tier.ttl_s)
                    pipe.execute()
            except redis.RedisError as exc:
                self._fail(exc)
            else:
                self._ok()

    # --- reading -------------------------------------------------------------------------------------------------

    def fetch(self, tokens: Sequence[int], salt: bytes, longer_than: int,
              check: Callable[[str, bytearray], str | None]) -> tuple[str, bytearray] | None:
        """The longest entry of ``salt`` whose tokens are a prefix of ``tokens`` longer than ``longer_than``, as
        (its local name, its bytes), that ``check`` (a reason it is bad, or None) accepted; None: a miss. A bad entry
        is deleted from the tier, logged and passed over."""
        if len(tokens) < HEAD_TOKENS or not self._usable():
            self._count("misses")
            return None
        try:
            lengths = cast(list[bytes], self._client.zrevrangebyscore(
                self._index_key(tokens, salt), len(tokens), f"({longer_than}", start=0, num=CANDIDATES))
            for raw in lengths:
                found = self._read(tokens, salt, int(raw), check)
                if found is not None:
                    self._ok()
                    self._count("hits")
                    return found
        except (redis.RedisError, ValueError) as exc:
            self._fail(exc)
        else:
            self._ok()
        self._count("misses")
        return None

    def _read(self, tokens: Sequence[int], salt: bytes, length: int,
              check: Callable[[str, bytearray], str | None]) -> tuple[str, bytearray] | None:
        """The entry holding ``tokens[:length]`` under ``salt``, checked; None if gone or bad (a bad one is
        deleted)."""
        if not HEAD_TOKENS <= length <= len(tokens):
            return None
        prefix, cap = tokens[:length], self._tier.entry_bytes
        key = self._entry_key(prefix, salt)
        data = bytearray(cast(bytes, self._client.getrange(key, 0, cap)))  # at most cap + 1 bytes: more is too long
        if not data:
            return None  # expired, or evicted by Redis
        name = self._address(prefix, salt)
        why = "longer than cache_remote_size" if len(data) > cap else check(name, data)
        if why is None:
            return name, data
        log.warning("remote store entry %s skipped and deleted: %s", key, why)
        self._client.delete(key)
        return None

    # --- figures and the end -------------------------------------------------------------------------------------

    def stats(self) -> RemoteStats:
        with self._lock:
            return RemoteStats(**self._counts)

    def close(self) -> None:
        """Send what is queued (each call bounded by the timeouts), then stop the sender."""
        self._jobs.put(None)
        self._sender.join()
        self._client.close()

    # --- keys and health -----------------------------------------------------------------------------------------

    def _entry_key(self, tokens: Sequence[int], salt: bytes) -> str:
        return f"mpserve:{self._key}:kv:{self._address(tokens, salt).split('.')[0]}"

    def _index_key(self, tokens: Sequence[int], salt: bytes) -> str:
        head = hashlib.sha256(struct.pack(f"<{HEAD_TOKENS}i", *tokens[:HEAD_TOKENS])).hexdigest()[:32]
        return f"mpserve:{self._key}:ix:{salt.hex() or '-'}:{head}"

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _usable(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._aside_until

    def _fail(self, exc: Exception) -> None:
        """A call failed: counted, the tier set aside for RETRY_S, and warned of once per outage."""
        with self._lock:
            self._counts["errors"] += 1
            self._aside_until = time.monotonic() + RETRY_S
            first, self._down = not self._down, True
        if first:
            log.warning("the remote store %s failed (%s); serving from the local tiers, trying it again every %.0f s",
                        self._tier.url, exc, RETRY_S)

    def _ok(self) -> None:
        with self._lock:
            back, self._down = self._down, False
        if back:
            log.warning("the remote store %s answers again", self._tier.url)


def _password(tier: RemoteTier) -> str | None:
    """The tier's password: its file's first line, else MPSERVE_CACHE_REMOTE_PASSWORD, else none."""
    if tier.password_file is not None:
        return read_password(tier.password_file)
    return os.environ.get(PASSWORD_ENV) or None
