"""The host store: saved sequence states (``llama_state_seq_get_data``) and their tokens, one store per host,
shared by every instance of every compatible model, outliving the instances (a crash, a scale-down, an unload,
a swap) and, with a disk tier, the server and the host.

    engine ─put(tokens, state, salt)─▶ writer thread ─▶ RAM tier ── full: least recently used ─▶ disk tier ── full:
                                                                                                      removed
                                                        └─ a new entry ─▶ the remote tier (Redis, Valkey), queued
           ─find(prompt, salt)──────▶ index (listing + headers) ─▶ the entry of that salt sharing the longest prefix
                                      └─ the remote tier's, if longer: checked as a file is, into the RAM tier
           ─load(entry)───────▶ its file, checked (magic, key, address, length, CRC) ─▶ the state, or a miss

With ``cache_remote``, a remote tier shared by hosts lies under the local ones (``mpserve.engine.remote_store``):
it holds the same entry files under the same addresses, written in the background and never waited for.

Why files in a tmpfs folder: every process on the host sees them with no server in between, a rename makes
a write atomic (a reader opens the old name or the new file, never half of one), an open file stays readable
while another process evicts it, and the kernel frees nothing a process still reads. The disk tier is the
same layout in another folder (``cache_disk``), written with fsync before the rename, so an entry found
there after a crash or a reboot is whole. Every entry is written through to it (by the writer thread, off
the engine's path), so the disk tier holds what RAM holds and more: a restart, or a reboot that empties the
tmpfs, finds them there.

Layout of a tier (``root``): ``root/lock`` (fcntl lock), ``root/KEY/ADDRESS.kv`` (entries), and
``root/KEY/identity.json`` (what KEY stands for, for people). The tiers are this user's alone
(``mpserve.private``): each folder 0700 and refused (``ConfigError``, naming it and the fix) if another
user owns it or others may enter it, each file 0600, made new (O_EXCL, no link followed) and opened without
following a link, as an entry's tokens are a prompt's text. KEY is a digest of everything a state depends on
(``compatibility_key``); ADDRESS is a digest of KEY, the entry's salt and its tokens (content addressing: two
instances saving one prefix under one salt write one entry). An entry file is

    MAGIC · header length (u32 LE) · CRC32 of the rest (u32 LE) · header (JSON: key, tokens, state bytes,
    summary, and the salt in hex unless empty) · tokens (int32 LE) · state

The salt is the reuse namespace of the request whose cells an entry holds (``mpserve.wire.salt``: empty for the
default tenant, else a digest of the tenant or of the ``cache_salt`` it named). An entry serves a prompt of its own
salt only, in both tiers: ``find`` and ``holds`` pass over the others, and its address depends on it, so one
tenant's prefix saved by another tenant's request is another entry. The empty salt leaves addresses as they were.

Compatibility: llama.cpp refuses a state saved with other KV types, another number of KV streams (a stream
per slot: ``parallel``; one with ``kv_unified``) or another V layout (flash attention off stores V
transposed), but takes without a word a state from another model of the same shape (a fine-tune) and one
computed by other kernels (repacked weights, GPU layers), whose numbers differ slightly. So the key holds the
GGUF's content digest (not its path), the KV types, the KV streams, the flash attention setting, repacking,
GPU layers, llama.cpp's version and its state format version. n_ctx is not in it: a state restores into any
context with room for its cells (``find`` passes over entries longer than the context).

Cutting back: a state restores with all its cells, and a prompt sharing only part of an entry's tokens cuts the
restored cells after what it shares. That works where every layer keeps every cell. A sliding-window model's state
holds, on its windowed layers, only the cells the next token attends to (llama.cpp saves no more), and a recurrent
state only its last position: restored, such a state serves a prompt that extends all of its tokens and no other
(``cut_back`` False). Then an entry is never dropped for a longer one that holds its tokens, and ``find`` takes
the longest entry that is all prefix of the prompt.

Sizes: every tier has a size, and a writer makes room before it writes, under the tier's lock, from a
listing of the tier (every key's entries and any temporary file count): no count is kept that a writer
killed halfway could leave wrong. A temporary file seen under the lock is an orphan (writers hold the lock
while they write) and is removed. Each writer keeps a tier within its own size, so with two servers of
different sizes on one host the tier stays within the larger, and shrinks to the smaller whenever its
server writes. Least recently used is the file's mtime, set on each hit. A bad entry (truncated, foreign,
a failed CRC, a header that is not this layout's: counts that do not add up to the file's size, a summary that
is not block hashes, a link or a file that is not ours) is removed and counted as skipped, never an exception
(every read is bounded by the file's size before anything is allocated for it); so is a write that fails (a
full disk: ENOSPC), which is logged and never reaches a client.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import os
import queue
import re
import struct
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpserve.config.remote_tier import RemoteTier
from mpserve.errors import ConfigError
from mpserve.private import PlantedFile, open_private, private_dir
from mpserve.wire.prefix import common_prefix

from .store_files import read_private, sha256, touch, write_atomic
from .store_format import MAGIC, MAX_HEADER_BYTES, PREFIX, address, read_header
from .store_stats import CacheStats, Changes, RemoteStats
from .store_tier import PART, Tier

if TYPE_CHECKING:
    from .remote_store import RemoteStore

log = logging.getLogger("mpserve.worker")

FORMAT = 1  # the entry layout; part of the key
_SHA256 = re.compile(r"[0-9a-f]{64}")
PENDING_WRITES = 4  # states waiting for the writer thread; admitting waits while this many are queued


@dataclass(frozen=True)
class _Job:
    """A write queued for the writer thread: an entry, or (``state`` None) a live sequence's entries forgotten."""

    tokens: tuple[int, ...]
    salt: bytes
    state: Any = None
    size: int = 0
    summary: tuple[int, ...] = ()
    live: bool = False  # the cells of a sequence still generating (``put_live``)


@dataclass(frozen=True)
class Entry:
    name: str  # ADDRESS.kv
    tokens: tuple[int, ...]
    summary: tuple[int, ...]
    salt: bytes = b""  # the reuse namespace it serves

    @property
    def id(self) -> int:
        """The entry's id on the wire (CACHE frames): the same for every instance on the host."""
        return int(self.name[:15], 16)


def compatibility_key(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def gguf_digest(path: str, cache_dir: Path) -> str:
    """The SHA-256 of the GGUF file at ``path``: computed once per file version on this host (cached in
    ``cache_dir``, a private folder of this user's outside the store, by device, inode, size and mtime), as a
    model is many hundred megabytes. A cached digest is a store key's part: nobody else may write one."""
    st = os.stat(path)
    known = cache_dir / f"gguf-{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}"
    try:
        private_dir(cache_dir, "digest cache folder")
    except ConfigError as exc:
        log.warning("%s; the model's digest is computed at every load meanwhile", exc.message)
        return sha256(path)
    try:
        noted = read_private(known, 64).decode()
        if _SHA256.fullmatch(noted):
            return noted
    except (OSError, UnicodeDecodeError):
        pass
    digest = sha256(path)
    try:
        write_atomic(known, digest.encode(), durable=False)
    except OSError as exc:
        log.warning("cannot note the model's digest in %s (%s); it is computed again next time", cache_dir, exc)
    return digest


def _remote_store(tier: RemoteTier, key: str) -> RemoteStore:
    """The remote tier's client; Redis's client library is loaded only by the instances that have a remote tier."""
    from .remote_store import RemoteStore
    return RemoteStore(tier, key, lambda tokens, salt: address(key, tokens, salt))


class HostStore:
    def __init__(self, key: str, identity: dict[str, Any], ram_dir: Path, ram_bytes: int, disk_dir: Path | None = None,
                 disk_bytes: int = 0, n_ctx: int = 1 << 30, cut_back: bool = True,
                 remote: RemoteTier | None = None) -> None:
        """``cut_back``: whether a restored state may be cut back to a prefix of its tokens (module docstring);
        ``remote``: the tier shared by hosts under the local ones (``mpserve.engine.remote_store``)."""
        self.key = key
        self._remote = _remote_store(remote, key) if remote else None
        self.cut_back = cut_back
        self.n_ctx = n_ctx
        self._tiers = [Tier("ram", ram_dir, ram_bytes, key, durable=False)]
        if disk_dir is not None and disk_bytes > 0:
            self._tiers.append(Tier("disk", disk_dir, disk_bytes, key, durable=True))
        for tier in self._tiers:
            note = tier.dir / "identity.json"
            if not note.exists():
                write_atomic(note, json.dumps(identity, indent=1, sort_keys=True).encode(), durable=False)
        self.capacity = sum(t.capacity for t in self._tiers)
        self.ram_capacity = ram_bytes
        self._index: dict[str, Entry] = {}
        self._index_lock = threading.RLock()  # the index, read and changed by the engine and the writer thread
        self._counts = {"hits": 0, "misses": 0, "evictions": 0, "skipped": 0}
        self._lock = threading.Lock()  # the counters and changes, shared with the writer thread
        self._added: dict[int, tuple[int, ...]] = {}
        self._dropped: list[int] = []
        self._kv_log: list[tuple[str, tuple[int, ...] | None, bytes]] | None = None  # KV events (take_kv_log)
        self._pending: set[tuple[bytes, tuple[int, ...]]] = set()  # (salt, tokens) queued for the writer
        self._jobs: queue.Queue[_Job | None] = queue.Queue(PENDING_WRITES)
        self._writer = threading.Thread(target=self._write_loop, name="host-store-writer", daemon=True)
        self._writer.start()

    # --- what the engine asks ------------------------------------------------------------------------

    def wants(self, size: int) -> bool:
        """Whether a state of ``size`` bytes fits a tier at all (it need not be read otherwise)."""
        return 0 < size + 4096 <= max(t.capacity for t in self._tiers)

    def holds(self, tokens: Sequence[int], salt: bytes = b"") -> bool:
        """Whether an entry (or a write queued) of ``salt`` serves ``tokens``: holds them as a prefix of its own (as
        its own tokens, where states are not cut back)."""
        key = tuple(tokens)
        with self._lock:
            if any(s == salt and self._serves(p, key) for s, p in self._pending):
                return True
        return any(e.salt == salt and self._serves(e.tokens, key) for e in self._refresh())

    def _serves(self, held: tuple[int, ...], tokens: tuple[int, ...]) -> bool:
        return held == tokens or self.cut_back and held[:len(tokens)] == tokens

    def put(self, tokens: Sequence[int], state: Any, size: int, summary: tuple[int, ...] = (),
            salt: bytes = b"") -> None:
        """Queue ``state``, the cells of ``tokens`` computed under ``salt``, for the writer thread (which owns the
        buffer from now)."""
        key = tuple(tokens)
        if not self.wants(size):
            return
        with self._lock:
            self._pending.add((salt, key))
        self._jobs.put(_Job(key, salt, state, size, summary))

    def put_live(self, tokens: Sequence[int], state: Any, size: int, salt: bytes, wait: float = 0.0) -> bool:
        """Queue ``state``, the cells of a sequence still generating (``tokens``: its prompt and the tokens decoded so
        far), under its live salt (``mpserve.engine.live``), unless the writer has no room for it within ``wait``
        seconds (False: not queued). It goes to the RAM tier only, is told to no one (the broker, the remote tier,
        the KV events), and replaces that salt's entries whose tokens it extends."""
        if not self.wants(size):
            return False
        try:
            self._jobs.put(_Job(tuple(tokens), salt, state, size, live=True), block=wait > 0, timeout=wait or None)
        except queue.Full:
            return False
        return True

    def forget_live(self, tokens: Sequence[int], salt: bytes) -> None:
        """Remove, after the writes queued before, the entries of live salt ``salt`` that ``tokens`` extend: the
        sequence they were saved for ended."""
        self._jobs.put(_Job(tuple(tokens), salt, live=True))

    def find(self, tokens: Sequence[int], salt: bytes = b"") -> tuple[Entry | None, int]:
        """The entry of ``salt`` sharing the longest prefix with ``tokens`` (one this context has room for; where
        states are not cut back, one whose tokens are all that prefix), and its length."""
        key = tuple(tokens)
        best, shared = None, 0
        for entry in self._refresh():
            if entry.salt != salt:
                continue
            n = common_prefix(entry.tokens, key)
            if n > shared and len(entry.tokens) < self.n_ctx and (self.cut_back or n == len(entry.tokens)):
                best, shared = entry, n
        fetched = self._fetch_remote(key, salt, shared) if self._remote is not None and shared < len(key) else None
        return (fetched, len(fetched.tokens)) if fetched is not None else (best, shared)

    def load(self, entry: Entry) -> tuple[Any, int] | None:
        """``entry``'s state as a byte array, and its size; None if no tier has it whole (a bad file is
        removed, and counted as skipped). A hit makes it the most recently used; one found on disk only is
        copied back into RAM."""
        for tier in self._tiers:
            path = tier.path(entry.name)
            try:
                data = read_private(path)
            except FileNotFoundError:
                continue
            except PlantedFile as exc:
                self._skip(tier, path, exc.strerror or str(exc))
                continue
            except OSError as exc:
                log.warning("cannot read store entry %s: %s", path, exc)
                continue
            parsed = self._parse(data, entry.name)
            if isinstance(parsed, str):
                self._skip(tier, path, parsed)
                continue
            tokens, summary, offset, size = parsed
            touch(path)
            if tier is not self._tiers[0] and self.wants(size):
                self._copy_up(bytes(data))
            return (ctypes.c_uint8 * size).from_buffer(data, offset), size
        return None

    def count(self, hit: bool) -> None:
        with self._lock:
            self._counts["hits" if hit else "misses"] += 1

    def stats(self) -> CacheStats:
        ram = self._tiers[0]
        disk = self._tiers[1] if len(self._tiers) > 1 else None
        with self._lock:
            c = dict(self._counts)
        remote = self._remote.stats() if self._remote is not None else RemoteStats()
        return CacheStats(ram.capacity, ram.held(), len(self._refresh()), c["hits"], c["misses"], c["evictions"],
                          disk.held() if disk else 0, disk.capacity if disk else 0, c["skipped"], remote)

    def take_kv_log(self) -> list[tuple[str, tuple[int, ...] | None, bytes]]:
        """The entries this instance wrote and removed since the last call, for its KV events (name, tokens or None
        when removed, salt); the first call starts the log."""
        with self._lock:
            log, self._kv_log = self._kv_log or [], []
        return log

    def take_changes(self) -> Changes:
        with self._lock:
            changes = Changes(tuple(self._added.items()), tuple(self._dropped))
            self._added, self._dropped = {}, []
        return changes

    def snapshot(self, max_entries: int, max_hashes: int) -> Changes:
        """Every entry of this key with a summary, as added (up to ``max_entries`` and ``max_hashes``): what a
        registering instance tells the broker the host holds."""
        added: list[tuple[int, tuple[int, ...]]] = []
        hashes = 0
        for entry in self._refresh():
            if entry.summary and len(added) < max_entries and hashes + len(entry.summary) <= max_hashes:
                added.append((entry.id, entry.summary))
                hashes += len(entry.summary)
        with self._lock:
            self._added, self._dropped = {}, []
        return Changes(tuple(added))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the writes queued so far are made (at most ``timeout`` seconds: whether they were)."""
        done = self._jobs.all_tasks_done
        with done:
            return done.wait_for(lambda: not self._jobs.unfinished_tasks, timeout)

    def close(self) -> None:
        """Finish the writes queued (the entries outlive this instance), then stop the writer."""
        self._jobs.put(None)
        self._writer.join()
        if self._remote is not None:
            self._remote.close()

    # --- the index -------------------------------------------------------------------------------------

    def _refresh(self) -> list[Entry]:
        """The entries of this key in any tier, from a listing: new names' headers are read (an entry never
        changes under its name), names gone are forgotten. Both threads ask: the index has a lock of its own."""
        with self._index_lock:
            names: set[str] = set()
            for tier in self._tiers:
                for name in tier.names() - names:
                    names.add(name)
                    if name not in self._index:
                        entry = self._read_head(tier, name)
                        if entry is not None:
                            self._index[name] = entry
            for gone in self._index.keys() - names:
                del self._index[gone]
            return list(self._index.values())

    def _read_head(self, tier: Tier, name: str) -> Entry | None:
        """The entry ``name`` of ``tier`` from its header and tokens, each part checked and each read bounded by
        the file's size; a bad one is skipped (removed and counted), never an exception."""
        path = tier.path(name)
        try:
            with os.fdopen(open_private(path), "rb") as f:
                file_size = os.fstat(f.fileno()).st_size
                head = f.read(PREFIX.size)
                if len(head) == PREFIX.size:
                    head += f.read(min(PREFIX.unpack(head)[1], MAX_HEADER_BYTES))
                header = read_header(head, file_size, self.key)
                if isinstance(header, str):
                    return self._skip(tier, path, header)
                raw = f.read(4 * header.tokens)  # no more than the file holds: _header checked its sizes
        except FileNotFoundError:
            return None
        except OSError as exc:
            return self._skip(tier, path, f"it cannot be read ({exc.strerror or exc})")
        if len(raw) != 4 * header.tokens:
            return self._skip(tier, path, "truncated")
        tokens = struct.unpack(f"<{header.tokens}i", raw)
        if address(self.key, tokens, header.salt) != name:
            return self._skip(tier, path, "its name is not its tokens' address")
        return Entry(name, tokens, header.summary, header.salt)

    def _parse(self, data: bytearray, name: str) -> tuple[tuple[int, ...], tuple[int, ...], int, int] | str:
        """A whole entry file checked: (tokens, summary, state offset, state bytes), or why it is bad."""
        header = read_header(data, len(data), self.key)
        if isinstance(header, str):
            return header
        if zlib.crc32(memoryview(data)[PREFIX.size:]) != header.crc:
            return "truncated or damaged (CRC)"
        start = PREFIX.size + header.length
        tokens = struct.unpack_from(f"<{header.tokens}i", data, start)
        if address(self.key, tokens, header.salt) != name:
            return "its name is not its tokens' address"
        return tokens, header.summary, start + 4 * header.tokens, header.state_bytes

    def _skip(self, tier: Tier, path: Path, why: str) -> Entry | None:
        """Remove the bad entry at ``path``, saying why; None (no entry), for the readers that return one."""
        log.warning("store entry %s (%s tier) skipped and removed: %s", path.name, tier.name, why)
        try:
            os.unlink(path)
        except OSError:
            pass
        with self._index_lock:
            self._index.pop(path.name, None)
        with self._lock:
            self._counts["skipped"] += 1
        return None

    # --- writing (the writer thread) ----------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            try:
                if job.state is None:
                    self._forget_extended(job.tokens, job.salt, itself=True, told=False)
                else:
                    self._write(job)
            except Exception:  # a store that cannot be written is a store that is not used, never a dead worker
                log.exception("writing a store entry failed")
            finally:
                with self._lock:
                    self._pending.discard((job.salt, job.tokens))
                self._jobs.task_done()

    def _write(self, job: _Job) -> None:
        tokens, state, size, summary, salt = job.tokens, job.state, job.size, job.summary, job.salt
        name = address(self.key, tokens, salt)
        fields: dict[str, Any] = {"key": self.key, "tokens": len(tokens), "state_bytes": size, "summary": list(summary)}
        if salt:
            fields["salt"] = salt.hex()
        header = json.dumps(fields).encode()
        data = bytearray(PREFIX.size) + header + struct.pack(f"<{len(tokens)}i", *tokens)
        data += memoryview(state).cast("B")[:size]
        PREFIX.pack_into(data, 0, MAGIC, len(header), zlib.crc32(memoryview(data)[PREFIX.size:]))
        if any(tier.path(name).exists() for tier in self._tiers):
            touch(self._tiers[0].path(name))
            return
        written = self._store(0, name, data)
        if len(self._tiers) > 1 and not job.live and not self._tiers[1].path(name).exists():
            written = self._store(1, name, data) or written  # written through: the disk tier outlives a reboot
        if not written:
            return
        if not job.live:
            if self._remote is not None:
                self._remote.offer(tokens, salt, data)
            self._announce(name, tokens, summary, salt)
        if self.cut_back or job.live:  # (else a shorter entry serves the prompts that share only part of this one)
            self._forget_extended(tokens, salt, itself=False, told=not job.live)  # it serves what a shorter one did

    def _forget_extended(self, tokens: tuple[int, ...], salt: bytes, itself: bool, told: bool) -> None:
        """Remove the entries of ``salt`` whose tokens ``tokens`` extend (``itself``: its own entry too; ``told``:
        entries the KV events were told of, not live ones)."""
        for entry in [e for e in self._refresh() if e.salt == salt and tokens[:len(e.tokens)] == e.tokens]:
            if itself or entry.tokens != tokens:
                self._forget(entry, told)

    def _forget(self, entry: Entry, told: bool) -> None:
        """Remove ``entry`` from every tier (it adds nothing now); ``told``: the KV events hear of it."""
        for tier in self._tiers:
            try:
                os.unlink(tier.path(entry.name))
            except FileNotFoundError:
                continue
        with self._index_lock:
            self._index.pop(entry.name, None)
        with self._lock:
            if entry.summary and self._added.pop(entry.id, None) is None:
                self._dropped.append(entry.id)
            if self._kv_log is not None and told:
                self._kv_log.append((entry.name, None, entry.salt))

    def _fetch_remote(self, tokens: tuple[int, ...], salt: bytes, shared: int) -> Entry | None:
        """An entry of the remote tier holding more of ``tokens`` than ``shared`` (all of its tokens a prefix of
        them, and fewer than the context holds), checked as a file of a local tier is and its tokens compared with
        the prompt's, then written into the RAM tier and indexed; None if there is none."""
        assert self._remote is not None
        found: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

        def check(name: str, data: bytearray) -> str | None:
            parsed = self._parse(data, name)
            if isinstance(parsed, str):
                return parsed
            if parsed[0] != tokens[:len(parsed[0])]:
                return "its tokens are not the prompt's"
            found.append(parsed[:2])
            return None

        fetched = self._remote.fetch(tokens[:self.n_ctx - 1], salt, shared, check)
        if fetched is None:
            return None
        (name, data), (held, summary) = fetched, found[-1]
        if not self._store(0, name, data) and not self._tiers[0].path(name).exists():
            return None
        entry = Entry(name, held, summary, salt)
        with self._index_lock:
            self._index[name] = entry
        self._announce(name, held, summary, salt)
        return entry

    def _announce(self, name: str, tokens: tuple[int, ...], summary: tuple[int, ...], salt: bytes) -> None:
        """A new entry of this key in a local tier: its summary for the broker, and the KV events' log."""
        with self._lock:
            if summary:
                self._added[int(name[:15], 16)] = summary
            if self._kv_log is not None:
                self._kv_log.append((name, tokens, salt))

    def _copy_up(self, data: bytes) -> None:
        """An entry read from disk, into RAM: it is the most recently used now."""
        _, length, _ = PREFIX.unpack_from(data)
        header = json.loads(data[PREFIX.size:PREFIX.size + length])
        tokens = struct.unpack_from(f"<{int(header['tokens'])}i", data, PREFIX.size + length)
        self._store(0, address(self.key, tokens, bytes.fromhex(header.get("salt", ""))), data)

    def _store(self, level: int, name: str, data: bytes | bytearray) -> bool:
        """Write ``data`` as entry ``name`` into tier ``level``, making room by moving its least recently used
        entries down a tier (or removing them from the last); False if it was not written."""
        tier = self._tiers[level]
        if len(data) > tier.capacity:
            return level + 1 < len(self._tiers) and self._store(level + 1, name, data)
        with tier.lock():
            if tier.path(name).exists():  # another instance wrote it since ``_write`` looked: not twice
                return False
            listing = tier.listing()
            held = sum(size for _, size, _ in listing)
            for _, size, path in listing:
                if held + len(data) <= tier.capacity:
                    break
                self._make_room(level, path)
                held -= size
            try:
                write_atomic(tier.path(name), data, tier.durable, PART)
            except OSError as exc:
                with self._lock:
                    self._counts["skipped"] += 1
                why = "the tier's file system is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else exc.strerror
                log.warning("store entry %s not written to the %s tier (%s): %s; the prompt is computed when "
                            "asked for again", name, tier.name, tier.root, why)
                return False
            finally:
                tier.stale()
        return True

    def _make_room(self, level: int, path: Path) -> None:
        """Evict ``path`` from tier ``level`` (whose lock is held): down into the next tier, if there is one."""
        if level + 1 < len(self._tiers):
            lower = self._tiers[level + 1]
            if not lower.path(path.name).exists():
                try:
                    data = path.read_bytes()
                except OSError:
                    data = b""
                if data:
                    self._store(level + 1, path.name, data)
            else:
                touch(lower.path(path.name))
        else:
            with self._lock:
                self._counts["evictions"] += 1
                if path.parent.name == self.key and not any(t.path(path.name).exists() for t in self._tiers[:level]):
                    entry_id = int(path.name[:15], 16)
                    if self._added.pop(entry_id, None) is None:
                        self._dropped.append(entry_id)
                    if self._kv_log is not None:
                        self._kv_log.append((path.name, None, b""))
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
