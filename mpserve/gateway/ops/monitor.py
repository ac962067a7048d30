"""What the gateway reports about instances: health per model, the backend monitor, observed restarts.

Two sources, used together when both are there: the broker's STATS (queues, requests running, instances
registered) and, for a server on this host, the slot table plus ``/proc`` (each instance's state, process,
memory) and, when NVML answers, each GPU's memory and what each instance's process holds on it. A row's
state is what its worker last wrote; a worker killed outright cannot update it, so a row whose process is
gone (or a zombie not yet reaped) counts as ``exited`` whatever it says.

Whose requests a view shows is its ``Viewer``'s: every request for the admin key (and on a gateway without API
keys, whose callers are one tenant); a keyed caller sees its own requests (ids, token counts, KV cells) and of
the others only that a slot is busy, never what runs there (``http.keys``: its ids carry its tenant's tag).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from starlette.requests import Request

from mpserve.gpu.memory import GpuUsage, memory_by_pid, read_usage
from mpserve.models.progress import downloads
from mpserve.runtime import ServerInfo
from mpserve.wire import protocol as wire
from mpserve.wire.slots import SlotRow, SlotState, active_sets, instance_slots

from ..http import keys

READY = frozenset({"idle", "busy", "waiting"})  # loaded and able to run a request
BUSY = frozenset({"busy", "waiting"})
LOADING = frozenset({"starting", "loading"})
DOWN = frozenset({"dead", "failed", "exited", "stopping"})


def process_alive(pid: int) -> bool:
    """True for a running process; False for none, or a zombie (dead, waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZXx"


def state_of(row: SlotRow) -> str:
    """The row's state, lower case; ``exited`` when it claims a process that is gone."""
    name = row.state.name.lower()
    if row.pid > 0 and row.state not in (SlotState.DEAD, SlotState.FAILED) and not process_alive(row.pid):
        return "exited"
    return name


def process_memory(pid: int) -> tuple[int | None, int | None]:
    """Resident set size and proportional set size in bytes (None where /proc does not tell). PSS shares
    each page among the processes that map it, so the PSS of all instances adds up to what they really use;
    RSS counts the shared model pages once per instance."""
    return (_kib_field(Path(f"/proc/{pid}/status"), "VmRSS:"), _kib_field(Path(f"/proc/{pid}/smaps_rollup"), "Pss:"))


def _kib_field(path: Path, name: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(name):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# --- the backend monitor ------------------------------------------------------------------------

def instance_state(slots: Sequence[SlotRow]) -> str:
    """One state for an instance (one process) from its slots' rows: busy (or else waiting) when a slot serves,
    else its first slot's (a worker writes its other states to all its rows at once)."""
    states = [state_of(r) for r in slots]
    return next((s for s in ("busy", "waiting") if s in states), states[0])


@dataclass(frozen=True)
class Viewer:
    """Whose requests a view shows: every one (``tenant`` None: the admin, or a gateway without API keys), or
    those of ``tenant`` alone, under the ids its caller gave them."""

    tenant: str | None = None

    @property
    def sees_all(self) -> bool:
        return self.tenant is None

    def request(self, row: SlotRow) -> str | None:
        """``row``'s request id as this viewer may see it: None if it is not the viewer's (or there is none)."""
        if not row.request:
            return None
        return row.request if self.tenant is None else keys.own_id(row.request, self.tenant)


ADMIN = Viewer()


def viewer_of(request: Request) -> Viewer:
    """Who asks for a view: the admin (its key, which the key check let through to the views, or any caller of a
    gateway without API keys: one tenant) or the tenant of the caller's key."""
    tenant = keys.tenant(request)
    return ADMIN if keys.is_admin(request) or not tenant else Viewer(tenant)


@dataclass(frozen=True)
class SlotView:
    """One slot of an instance: what it runs (its request's figures: None where they are not the viewer's)."""

    slot: int  # its row in the slot table (SLOT in ``mpserve status``)
    state: str
    request: str | None  # the request running now
    tokens: int | None  # generated for the current (or last) request
    kv_cells: int | None  # KV cells the slot holds, of kv_capacity
    kv_capacity: int
    adapters: str  # the LoRA adapters its running (or last) sequence runs under; "": the base model

    @classmethod
    def of(cls, row: SlotRow, viewer: Viewer = ADMIN) -> SlotView:
        state, shown = state_of(row), viewer.request(row)
        if not viewer.sees_all and shown is None:
            return cls(row.index, state, None, None, None, row.kv_capacity, "")
        return cls(row.index, state, shown if state in BUSY else None, row.tokens, row.kv_cells, row.kv_capacity,
                   row.adapters)


@dataclass(frozen=True)
class InstanceView:
    """One instance: one worker process, its figures counted once, and its slots."""

    worker: int
    model: str
    pid: int
    state: str  # ``instance_state``
    device: str  # "cpu" or "gpuN"
    rss_bytes: int | None
    pss_bytes: int | None
    requests_served: int
    uptime_s: float | None  # since the worker process started; None when it is not running
    load_s: float
    gpu_memory_bytes: int | None  # what its process holds on GPUs (NVML); None: unknown or on the CPU
    kv_cells: int | None  # KV cells its slots hold, of kv_capacity (None: some hold others' requests' cells)
    kv_capacity: int
    prompt_cache_bytes: int  # the host store's RAM tier (the host's), of prompt_cache_capacity
    prompt_cache_capacity: int
    prompt_cache_disk_bytes: int  # its disk tier, of prompt_cache_disk_capacity (0: none)
    prompt_cache_disk_capacity: int
    prompt_cache_hits: int  # this instance's prompts that restored a prefix from the store
    prompt_cache_misses: int
    prompt_cache_evictions: int
    prompt_cache_skipped: int  # bad entries removed, writes not made
    active_adapters: list[str]  # the LoRA adapter sets its running sequences use ("base": none), taking turns
    slots: tuple[SlotView, ...]

    @classmethod
    def of(cls, rows: Sequence[SlotRow], now: float, gpu_held: Mapping[int, int],
           viewer: Viewer = ADMIN) -> InstanceView:
        first = rows[0]
        slots = tuple(SlotView.of(r, viewer) for r in rows)
        state = instance_state(rows)
        running = first.pid > 0 and state not in DOWN
        rss, pss = process_memory(first.pid) if running else (None, None)
        cache = first.cache
        return cls(first.worker, first.model, first.pid, state, "cpu" if first.device < 0 else f"gpu{first.device}",
                   rss, pss, max(r.served for r in rows),  # a worker writes its count to the slot that ended last
                   round(now - first.started, 3) if running and first.started else None, round(first.load_s, 3),
                   gpu_held.get(first.pid) if running and first.device >= 0 else None,
                   _total(s.kv_cells for s in slots), sum(r.kv_capacity for r in rows), cache.bytes, cache.capacity,
                   cache.disk_bytes, cache.disk_capacity, cache.hits, cache.misses, cache.evictions, cache.skipped,
                   active_sets(rows), slots)


def _total(counts: Iterable[int | None]) -> int | None:
    """The sum of ``counts``, None if any is unknown to the viewer."""
    known = list(counts)
    return None if None in known else sum(c for c in known if c is not None)


def gpu_usage(rows: Sequence[SlotRow]) -> list[GpuUsage] | None:
    """NVML's view of the GPUs when some instance runs on one; None otherwise, or without NVML."""
    return read_usage() if any(r.device >= 0 and r.state is not SlotState.EMPTY for r in rows) else None


def monitor(rows: list[SlotRow], model: str | None, gpus: Sequence[GpuUsage] | None = None,
            viewer: Viewer = ADMIN) -> dict[str, Any]:
    """``GET /backend/monitor``: every instance of ``model`` (all models when None) with its slots (their requests
    as ``viewer`` may see them), the totals (each process counted once, however many slots it has), each GPU's
    memory (``gpus``, from ``gpu_usage``; [] when unknown), and the downloads running on this host."""
    now = time.time()
    held = memory_by_pid(gpus)
    views = [InstanceView.of(slots, now, held, viewer)
             for (name, _), slots in instance_slots(rows).items() if model in (None, name)]
    return {
        "model": model,
        "instances": [asdict(v) for v in views],
        "slots": sum(len(v.slots) for v in views),
        "rss_bytes": sum(v.rss_bytes or 0 for v in views),
        "pss_bytes": sum(v.pss_bytes or 0 for v in views),
        "gpu_memory_bytes": sum(v.gpu_memory_bytes or 0 for v in views),
        "gpus": [asdict(g) for g in gpus or []],
        "downloads": downloads(),  # models being downloaded on this host, before their server starts
    }


# --- health -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelHealth:
    """Instances (worker processes) of one model by what they can do now, their slots, and its queue. From the
    slot table when the server is local, plus remote pools' workers registered with it (STATS); from STATS alone
    otherwise, where the broker's registered instances count as ready and the fields it cannot know are None."""

    ready: int  # instances loaded and alive: idle or serving
    busy: int  # of those, serving a request in some slot
    unloaded: int | None  # alive, registered, model not in memory: loads on the next request
    loading: int | None
    down: int | None  # dead, failed, exited or stopping
    ready_slots: int  # the slots of the ready instances
    busy_slots: int  # of those, running a request
    queued: int
    running: int
    failed: str | None  # why the model cannot load, once the supervisor gave up
    on_demand: bool = False  # min 0 instances: with none running, a request starts one

    @property
    def can_serve(self) -> bool:
        return self.failed is None and (self.ready + (self.unloaded or 0) > 0 or self.on_demand)


def health(stats: wire.Stats, rows: list[SlotRow] | None) -> dict[str, ModelHealth]:
    out = {}
    for name, m in stats.models.items():
        known = [w for w in stats.workers if w.model == name and (w.host or rows is None)]  # not in the slot table
        ready, busy = len(known), sum(1 for w in known if w.running)
        ready_slots, busy_slots = sum(w.capacity for w in known), sum(w.running for w in known)
        unloaded = loading = down = None
        if rows is not None:
            instances = [slots for (model, _), slots in instance_slots(rows).items() if model == name]
            states = [instance_state(slots) for slots in instances]
            counts = Counter(states)
            up = [slots for slots, state in zip(instances, states, strict=True) if state in READY]
            ready, busy = ready + len(up), busy + sum(counts[s] for s in BUSY)
            ready_slots += sum(map(len, up))
            busy_slots += sum(1 for slots in up for r in slots if state_of(r) in BUSY)
            unloaded, loading, down = counts["unloaded"], sum(counts[s] for s in LOADING), sum(counts[s] for s in DOWN)
        out[name] = ModelHealth(ready, busy, unloaded, loading, down, ready_slots, busy_slots, m.queued, m.running,
                                m.failed, _on_demand(m))
    return out


def _on_demand(m: wire.ModelStats) -> bool:
    return m.scaling.min == 0 and m.scaling.max > 0


# --- restarts -----------------------------------------------------------------------------------

class RestartCounter:
    """Worker restarts per model, as seen from outside: a slot whose process id changes from one running
    process to another was restarted. The gateway samples the slot table twice a second; a worker restart
    takes longer than that (a fresh interpreter, then the model load), so none is missed in practice.
    Counts start again when the server itself is restarted."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._server: tuple[int, float] | None = None
        self._pids: dict[int, int] = {}

    def observe(self, server: ServerInfo, rows: list[SlotRow]) -> None:
        if self._server != (server.pid, server.started):
            self._server, self._pids = (server.pid, server.started), {}
            self.counts.clear()
        for row in rows:
            if row.pid <= 0:
                continue
            before = self._pids.get(row.index)
            if before is not None and before != row.pid:
                self.counts[row.model] += 1
            self._pids[row.index] = row.pid
