"""Live GPU memory: used and free per GPU, and what each process holds, read from NVML when asked.

    pynvml (mpserve[nvml]) ──▶ read_usage() ──▶ [GpuUsage: index, uuid, total, used, free, processes]
        ├─▶ `mpserve devices`                 each GPU's used memory and the processes on it
        ├─▶ gateway /backend/monitor, /metrics  per GPU, and per instance by worker pid
        └─▶ the server, once per model        "estimated N GiB, uses M GiB" (EstimateCheck)

NVML only: it answers in-process, where nvidia-smi would cost a process per read (per /metrics scrape).
Without NVML (not installed, no driver) ``read_usage`` answers None and every reader shows nothing. Process
ids are the host's: in a container without the host's PID namespace they do not match the workers' ids, so
per-instance figures stay unknown there while the per-GPU ones are still right. Where the driver does not
tell a process's memory, its ``used`` is None.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .devices import Device, Nvml, format_memory
from .placement import Placement

log = logging.getLogger("mpserve.gpu")

_NOT_AVAILABLE = (1 << 64) - 1  # NVML_VALUE_NOT_AVAILABLE, which older pynvml releases pass on as is


class NvmlUsage(Nvml, Protocol):
    """The part of ``pynvml`` read here, beyond discovery's."""

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]: ...  # .pid, .usedGpuMemory


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used: int | None  # bytes; None when the driver does not tell


@dataclass(frozen=True)
class GpuUsage:
    index: int
    uuid: str
    name: str
    total: int  # bytes
    used: int
    free: int
    processes: tuple[GpuProcess, ...]


def read_usage(nvml: NvmlUsage | None = None) -> list[GpuUsage] | None:
    """Every GPU's memory now, or None without NVML; ``nvml`` stands in for pynvml (tests)."""
    if nvml is None:
        try:
            import pynvml  # optional (nvidia-ml-py), as in devices.py
        except ImportError:
            return None
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return None
    try:
        return [_one(nvml, index) for index in range(nvml.nvmlDeviceGetCount())]
    except nvml.NVMLError as exc:  # a GPU fell off the bus, a driver reload: nothing trustworthy now
        log.debug("NVML could not be read: %s", exc)
        return None
    finally:
        nvml.nvmlShutdown()


def _one(nvml: NvmlUsage, index: int) -> GpuUsage:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    try:
        running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except nvml.NVMLError:  # not supported on this device or driver
        running = []
    processes = tuple(GpuProcess(int(p.pid), _bytes(p.usedGpuMemory)) for p in running)
    name, uuid = nvml.nvmlDeviceGetName(handle), nvml.nvmlDeviceGetUUID(handle)
    return GpuUsage(index, uuid.decode() if isinstance(uuid, bytes) else uuid,
                    name.decode() if isinstance(name, bytes) else name,
                    int(memory.total), int(memory.total) - int(memory.free), int(memory.free), processes)


def _bytes(value: int | None) -> int | None:
    return None if value is None or value == _NOT_AVAILABLE else int(value)


def memory_by_pid(usage: Sequence[GpuUsage] | None) -> dict[int, int]:
    """Bytes each process holds, over all GPUs; processes whose memory the driver does not tell are left out."""
    held: dict[int, int] = {}
    for gpu in usage or ():
        for p in gpu.processes:
            if p.used is not None:
                held[p.pid] = held.get(p.pid, 0) + p.used
    return held


class EstimateCheck:
    """Logs, once per model, the placement's estimate beside what its first ready instance really holds."""

    def __init__(self, placements: Sequence[Placement] | Mapping[int, Placement], devices: Sequence[Device]) -> None:
        """``placements``: by worker index (a sequence: the index is the position)."""
        real = {d.index for d in devices if not d.simulated}
        by_index = placements.items() if isinstance(placements, Mapping) else enumerate(placements)
        self._pending: dict[int, Placement] = {
            index: p for index, p in by_index if p.device is not None and p.device in real}
        self._done: set[str] = set()

    def ready(self, worker: int, pid: int, usage: Mapping[int, int] | None = None) -> None:
        """Worker ``worker`` (process ``pid``) loaded its model; ``usage`` (pid -> bytes) stands in for NVML."""
        placement = self._pending.pop(worker, None)
        if placement is None or placement.model in self._done:
            return
        held = usage if usage is not None else memory_by_pid(read_usage())
        if pid not in held:
            return  # no NVML, or a pid NVML does not know (another PID namespace): nothing to compare
        self._done.add(placement.model)
        log.info("model %r on gpu%d: estimated %s, uses %s", placement.model, placement.device,
                 format_memory(placement.memory), format_memory(held[pid]))
