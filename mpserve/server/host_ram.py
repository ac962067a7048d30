"""Whether the instances that run on the CPU fit the host's RAM: checked before anything starts and printed by
``mpserve plan``, as each GPU instance's need is checked against its device (``mpserve.gpu.placement``).

    the CPU placements ──▶ RamNeed per model (``estimate_host_memory``: one instance's parts)
        weights        once for the model when its instances share them (forked from its zygote, or the
                       file's pages mapped read-only by each, when nothing is repacked); else once per instance
        adapters       its LoRA adapters: once when forked from its zygote (loaded before the fork), else once
                       per instance
        per instance   KV cache (parallel × n_ctx cells), compute buffers and the process
        once           the host store (cache_ram, one store for the whole host: a ceiling, filled as prompts come;
                       the largest of the models' where they differ)
    ──▶ against the RAM available: MemAvailable, the cgroup's headroom when lower, ram_budget when lower
    ──▶ ModelDoesNotFit when what must be resident does not fit (the parts named, and what to change first);
        a warning when only the host store's ceiling does not

Instances on a GPU are not counted here (their weights and KV cache are on the device), nor instances that a
model scales up to later.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mpserve.counts import counted
from mpserve.errors import ModelDoesNotFit
from mpserve.gpu.devices import format_memory
from mpserve.gpu.placement import MemoryEstimate


@dataclass(frozen=True)
class RamNeed:
    """One model's instances on the CPU."""

    model: str
    instances: int
    one: MemoryEstimate  # one instance's parts (``estimate_host_memory``)
    shared: bool  # its instances share one copy of the weights
    host_store: int  # cache_ram: the ceiling of the one host store, which every instance shares
    parallel: int
    n_ctx: int
    forked: bool = False  # forked from its zygote, which loaded the adapters: they are shared too

    @property
    def weights(self) -> int:
        """The model's weights and its adapters', as many times as they are loaded."""
        return (self.one.weights * (1 if self.shared else self.instances)
                + self.one.adapters * (1 if self.forked else self.instances))

    @property
    def resident(self) -> int:
        """What its instances hold once loaded, before any prompt is kept in the host store."""
        return self.weights + self.instances * (self.one.kv_cache + self.one.overhead + self.one.draft)

    def parts(self) -> str:
        copies = "once, shared by its instances" if self.shared or self.instances == 1 else \
            f"× {self.instances} (each instance loads its own)"
        draft = f" + draft model {format_memory(self.one.draft)}" if self.one.draft else ""
        if self.one.adapters:
            copies += f"; LoRA adapters {format_memory(self.one.adapters)} " + (
                "once, shared" if self.forked or self.instances == 1 else f"× {self.instances}")
        return (f"model {self.model!r}, {counted(self.instances, 'instance')}: weights "
                f"{format_memory(self.one.weights)} {copies}; per instance KV cache {format_memory(self.one.kv_cache)} "
                f"for parallel {self.parallel} × n_ctx {self.n_ctx} + compute buffers "
                f"{format_memory(self.one.overhead)}{draft}; the host store up to {format_memory(self.host_store)}")

    def hint(self) -> str:
        """What to change first: what is most of its need."""
        kv = self.instances * self.one.kv_cache
        context = f"a smaller parallel (now {self.parallel}) or n_ctx (now {self.n_ctx})"
        if kv >= self.weights:
            return f"{context}, or fewer instances"
        unshared = "start_method: fork (its instances then share one copy of the weights), " if not self.shared \
            and self.instances > 1 else ""
        return f"{unshared}fewer instances, a smaller (more quantized) model, or {context}"


@dataclass(frozen=True)
class Available:
    """The host RAM the server may take, and where that figure comes from."""

    bytes: int
    source: str  # "MemAvailable", "the cgroup's limit less its use", "ram_budget"


def available_ram(budget: int | None = None) -> Available | None:
    """MemAvailable, the cgroup's headroom (memory.max less memory.current) when lower, ``budget`` when lower;
    None when none is known (no /proc)."""
    known = [a for a in (_meminfo(), _cgroup_headroom()) if a is not None]
    if budget is not None:
        known.append(Available(budget, "ram_budget"))
    return min(known, key=lambda a: a.bytes, default=None)


def check_ram(needs: Sequence[RamNeed], available: Available | None) -> list[str]:
    """``ModelDoesNotFit`` when what the CPU instances hold once loaded exceeds ``available``; the warnings to log
    otherwise (the host store's ceiling does not fit)."""
    if available is None or not needs:
        return []
    resident, total = _resident_and_total(needs)
    if resident > available.bytes:
        worst = max(needs, key=lambda n: n.resident)
        raise ModelDoesNotFit(
            f"the instances on the CPU need {format_memory(resident)} of host RAM (estimated: "
            f"{'; '.join(n.parts() for n in needs)}) but {format_memory(available.bytes)} is available "
            f"({available.source}); try for model {worst.model!r} {worst.hint()}")
    if total > available.bytes:
        return [f"the host store may grow to {format_memory(total - resident)} of host RAM (cache_ram, one store "
                f"for the whole host), more than the {format_memory(available.bytes - resident)} left beside the "
                f"models ({format_memory(available.bytes)} available, {available.source}); lower cache_ram, or the "
                "host may swap"]
    return []


def format_ram(needs: Sequence[RamNeed], available: Available | None) -> str:
    """``mpserve plan``'s lines: each model's parts, then the total against what is available."""
    if not needs:
        return ""
    resident, total = _resident_and_total(needs)
    where = f"{format_memory(available.bytes)} available ({available.source})" if available is not None else \
        "an unknown amount available"
    return "\n".join([*(n.parts() for n in needs),
                      f"host RAM: {format_memory(resident)} planned, {format_memory(total)} with a full host store, "
                      f"of {where}"])


def _resident_and_total(needs: Sequence[RamNeed]) -> tuple[int, int]:
    """What the instances hold once loaded, and that with the host store full: one store for the host, as large
    as the largest ``cache_ram`` among the models."""
    resident = sum(n.resident for n in needs)
    return resident, resident + max(n.host_store for n in needs)


def _meminfo() -> Available | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return Available(int(line.split()[1]) * 1024, "MemAvailable")
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_headroom() -> Available | None:
    """cgroup v2: this process's group's memory.max less its memory.current (None: no limit, or not v2)."""
    try:
        group = next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines()
                     if line.startswith("0::"))
        folder = Path("/sys/fs/cgroup") / group.lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return Available(int(limit) - int((folder / "memory.current").read_text()), "the cgroup's limit less its use")
    except (OSError, ValueError, StopIteration):
        return None
