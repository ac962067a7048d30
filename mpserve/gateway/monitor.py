"""What the gateway reports about instances: health per model, the backend monitor, observed restarts.

Two sources, used together when both are there: the broker's STATS (queues, requests running, instances
registered) and, for a server on this host, the slot table plus ``/proc`` (each instance's state, process,
memory) and, when NVML answers, each GPU's memory and what each instance's process holds on it. A row's
state is what its worker last wrote; a worker killed outright cannot update it, so a row whose process is
gone (or a zombie not yet reaped) counts as ``exited`` whatever it says.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mpserve import protocol as wire
from mpserve.gpu.memory import GpuUsage, memory_by_pid, read_usage
from mpserve.runtime import ServerInfo
from mpserve.slots import SlotRow, SlotState

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

@dataclass(frozen=True)
class InstanceView:
    slot: int
    worker: int
    model: str
    pid: int
    state: str
    device: str  # "cpu" or "gpuN"
    rss_bytes: int | None
    pss_bytes: int | None
    requests_served: int
    uptime_s: float | None  # since the worker process started; None when it is not running
    load_s: float
    request: str | None  # the request running now
    tokens: int  # generated for the current (or last) request
    gpu_memory_bytes: int | None = None  # what its process holds on GPUs (NVML); None: unknown or on the CPU
    kv_cells: int = 0  # KV cells the slot holds, of kv_capacity
    kv_capacity: int = 0
    prompt_cache_bytes: int = 0  # the host store's RAM tier (the host's), of prompt_cache_capacity
    prompt_cache_capacity: int = 0
    prompt_cache_disk_bytes: int = 0  # its disk tier, of prompt_cache_disk_capacity (0: none)
    prompt_cache_disk_capacity: int = 0
    prompt_cache_hits: int = 0  # this instance's prompts that restored a prefix from the store
    prompt_cache_misses: int = 0
    prompt_cache_evictions: int = 0
    prompt_cache_skipped: int = 0  # bad entries removed, writes not made

    @classmethod
    def of(cls, row: SlotRow, now: float, gpu_held: Mapping[int, int]) -> InstanceView:
        state = state_of(row)
        running = row.pid > 0 and state not in DOWN
        rss, pss = process_memory(row.pid) if running else (None, None)
        return cls(row.index, row.worker, row.model, row.pid, state, "cpu" if row.device < 0 else f"gpu{row.device}",
                   rss, pss, row.served, round(now - row.started, 3) if running and row.started else None,
                   round(row.load_s, 3), row.request if state in BUSY and row.request else None, row.tokens,
                   gpu_held.get(row.pid) if running and row.device >= 0 else None, row.kv_cells, row.kv_capacity,
                   row.cache.bytes, row.cache.capacity, row.cache.disk_bytes, row.cache.disk_capacity,
                   row.cache.hits, row.cache.misses, row.cache.evictions, row.cache.skipped)


def gpu_usage(rows: Sequence[SlotRow]) -> list[GpuUsage] | None:
    """NVML's view of the GPUs when some instance runs on one; None otherwise, or without NVML."""
    return read_usage() if any(r.device >= 0 and r.state is not SlotState.EMPTY for r in rows) else None


def monitor(rows: list[SlotRow], model: str | None, gpus: Sequence[GpuUsage] | None = None) -> dict[str, Any]:
    """``GET /backend/monitor``: every instance of ``model`` (all models when None), with totals, and each GPU's
    memory (``gpus``, from ``gpu_usage``; [] when unknown). Slots of one instance share its process, whose GPU
    memory the total counts once."""
    now = time.time()
    held = memory_by_pid(gpus)
    views = [InstanceView.of(r, now, held) for r in rows if r.state is not SlotState.EMPTY and model in (None, r.model)]
    return {
        "model": model,
        "instances": [asdict(v) for v in views],
        "rss_bytes": sum(v.rss_bytes or 0 for v in views),
        "pss_bytes": sum(v.pss_bytes or 0 for v in views),
        "gpu_memory_bytes": sum({v.pid: v.gpu_memory_bytes for v in views if v.gpu_memory_bytes}.values()),
        "gpus": [asdict(g) for g in gpus or []],
    }


# --- health -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelHealth:
    """Instances of one model by what they can do now, and its queue. From the slot table when the server is
    local, plus the slots of remote pools' workers registered with it (STATS); from STATS alone otherwise,
    where the broker's registered instances count as ready and the fields it cannot know are None."""

    ready: int  # loaded, alive: idle or serving
    busy: int  # of those, serving a request
    unloaded: int | None  # alive, registered, model not in memory: loads on the next request
    loading: int | None
    down: int | None  # dead, failed, exited or stopping
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
        if rows is None:
            out[name] = ModelHealth(m.instances, m.instances - m.free_slots, None, None, None, m.queued, m.running,
                                    m.failed, _on_demand(m))
            continue
        states = Counter(state_of(r) for r in rows if r.model == name and r.state is not SlotState.EMPTY)
        remote = [w for w in stats.workers if w.host and w.model == name]  # remote pools' slots: not in the table
        out[name] = ModelHealth(
            ready=sum(states[s] for s in READY) + sum(w.capacity for w in remote),
            busy=sum(states[s] for s in BUSY) + sum(w.running for w in remote), unloaded=states["unloaded"],
            loading=sum(states[s] for s in LOADING), down=sum(states[s] for s in DOWN), queued=m.queued,
            running=m.running, failed=m.failed, on_demand=_on_demand(m))
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
