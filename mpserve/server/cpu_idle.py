"""CPU time left idle that this process could have used: what the busy-polling guard (``waiting``) reads.

    /proc/stat, the lines of the CPUs this process may run on ──▶ their idle + iowait seconds
    the cgroup's CPU quota, where one is set (v2: cpu.max, cpu.stat; v1: cpu.cfs_quota_us,
        cpu.cfs_period_us, cpuacct.usage)                     ──▶ quota × time − usage, in seconds

Both are running totals; over an interval the smaller increase is what was idle for this process. A
container's CPU limit is a quota: the host's CPUs may idle while the container has used its share, and
polling would then cost the models their time. Only the process's own cgroup is read (in a container, the
container's), not its ancestors.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

STAT = "/proc/stat"
CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"


class CpuIdle:
    """``seconds()``: the running totals of idle CPU seconds (one per source), or None if /proc/stat cannot be
    read (not Linux)."""

    def __init__(self, stat: str = STAT, cgroup: str = CGROUP, root: str = CGROUP_ROOT,
                 cpus: set[int] | None = None) -> None:
        self._stat = stat
        self._cpus = {f"cpu{i}".encode() for i in (os.sched_getaffinity(0) if cpus is None else cpus)}
        self._tick = os.sysconf("SC_CLK_TCK")
        self._quota = _Quota.find(cgroup, root)

    def seconds(self) -> tuple[float, ...] | None:
        idle = self._cpu_idle_s()
        if idle is None:
            return None
        quota = self._quota.idle_s() if self._quota is not None else None
        return (idle,) if quota is None else (idle, quota)

    def _cpu_idle_s(self) -> float | None:
        try:
            with open(self._stat, "rb") as f:
                lines = f.read().splitlines()
            ticks = sum(int(fields[4]) + int(fields[5]) for fields in map(bytes.split, lines[1:])
                        if fields and fields[0] in self._cpus)
        except (OSError, IndexError, ValueError):
            return None
        return ticks / self._tick


class _Quota:
    """A cgroup's CPU quota (CPUs) and where its usage is read."""

    def __init__(self, cpus: float, usage: Path, usage_unit_s: float, key: bytes | None) -> None:
        self.cpus, self._usage, self._unit, self._key = cpus, usage, usage_unit_s, key

    @classmethod
    def find(cls, cgroup: str, root: str) -> _Quota | None:
        """The quota of this process's cgroup (v2, or v1's cpu and cpuacct controllers), None if it has none."""
        try:
            lines = Path(cgroup).read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            hierarchy, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            path = path.lstrip("/")
            if hierarchy == "0" and not controllers:  # v2: one hierarchy, every controller
                quota = _quota_v2(Path(root, path, "cpu.max"))
                if quota is not None:
                    return cls(quota, Path(root, path, "cpu.stat"), 1e-6, b"usage_usec")
            elif "cpu" in controllers.split(","):  # v1: cpu and cpuacct, mounted together or apart
                quota = _quota_v1(Path(root, "cpu", path))
                if quota is not None:
                    return cls(quota, Path(root, "cpuacct", path, "cpuacct.usage"), 1e-9, None)
        return None

    def idle_s(self) -> float | None:
        try:
            text = self._usage.read_bytes()
            used = next(int(v) for k, v in (line.split() for line in text.splitlines()) if k == self._key) \
                if self._key is not None else int(text)
        except (OSError, ValueError, StopIteration):
            return None
        return self.cpus * time.monotonic() - used * self._unit


def _quota_v2(path: Path) -> float | None:
    try:
        quota, period = path.read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _quota_v1(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 else quota / period
