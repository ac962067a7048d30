"""Which GPUs this host has, and how much memory each has free.

Sources, first match wins:

1. simulated devices, from the ``simulate`` argument or ``$MPSERVE_SIMULATE_GPUS`` ("2x24GiB",
   "24GiB,16GiB"): for planning and tests on hosts without a GPU;
2. NVML through ``pynvml`` (package nvidia-ml-py), when it is installed and a driver answers;
3. ``nvidia-smi``, when it is on PATH and succeeds;
4. none: the host is CPU only.

Indices are NVML's (PCI bus order), which is not CUDA's default order. A worker should therefore
select its GPU by UUID (``CUDA_VISIBLE_DEVICES=GPU-…``) or run with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mpserve.config.sizes import parse_memory
from mpserve.errors import ConfigError

SIMULATE_ENV = "MPSERVE_SIMULATE_GPUS"
NVIDIA_SMI_QUERY = "index,name,uuid,memory.total,memory.free"
NVIDIA_SMI_TIMEOUT_S = 10.0

_MIB = 1 << 20
_COUNT_TIMES = re.compile(r"\s*(\d+)\s*[xX]\s*(.+)")


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    uuid: str
    memory_total: int  # bytes
    memory_free: int  # bytes, when discovered
    simulated: bool = False

    @property
    def key(self) -> str:
        """The name of the device's permit lock file.

        The UUID when known: servers that see one GPU under different indices (through
        CUDA_VISIBLE_DEVICES, say) must still meet on the same permits.
        """
        return re.sub(r"[^A-Za-z0-9._-]", "_", self.uuid or f"gpu{self.index}")


class Nvml(Protocol):
    """The part of the ``pynvml`` module that discovery uses."""

    @property
    def NVMLError(self) -> type[Exception]: ...

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetName(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...  # has .total and .free, in bytes


def discover(allowed: Sequence[int] | None = None, simulate: str | None = None) -> list[Device]:
    """The host's GPUs (see the module docstring for the order of sources), restricted to ``allowed``."""
    found, _ = detect(simulate)
    return found if allowed is None else restrict(found, allowed)


def detect(simulate: str | None = None) -> tuple[list[Device], str]:
    """The host's GPUs and the source that answered: "simulated", "NVML", "nvidia-smi", or "none"."""
    spec = simulate if simulate is not None else os.environ.get(SIMULATE_ENV, "")
    if spec:
        return parse_simulated(spec), "simulated"
    from_nvml = _from_installed_nvml()
    if from_nvml is not None:
        return from_nvml, "NVML"
    from_smi = _from_nvidia_smi()
    return from_smi, "nvidia-smi" if from_smi else "none"


def restrict(devices: Sequence[Device], allowed: Sequence[int]) -> list[Device]:
    """The devices whose index is in ``allowed``, in host order; an index the host lacks is a ConfigError."""
    present = {device.index for device in devices}
    missing = sorted(set(allowed) - present)
    if missing:
        have = ", ".join(f"GPU {d.index} ({d.name})" for d in devices) or "no GPUs"
        raise ConfigError(f"GPU {', '.join(map(str, missing))} is not on this host; it has {have}")
    return [device for device in devices if device.index in allowed]


def format_memory(size: int) -> str:
    """A byte count for people: "7.2 GiB", "512.0 MiB", "96 B"."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(size) >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def parse_simulated(spec: str) -> list[Device]:
    """Devices from "2x24GiB" or "24GiB,16GiB" (or both: "2x24GiB,16GiB"); all memory free."""
    sizes: list[int] = []
    for item in spec.split(","):
        repeated = _COUNT_TIMES.fullmatch(item)
        count, size = (int(repeated.group(1)), repeated.group(2)) if repeated else (1, item)
        try:
            sizes += [parse_memory(size)] * count
        except ConfigError as exc:
            raise ConfigError(f"simulated GPUs {spec!r} (e.g. '2x24GiB' or '24GiB,16GiB'): {exc.message}") from None
    return [
        Device(index, "Simulated GPU", f"SIM-{index}", size, size, simulated=True) for index, size in enumerate(sizes)
    ]


def devices_from_nvml(nvml: Nvml) -> list[Device] | None:
    """The devices NVML reports, or None when NVML cannot start (no driver, no library)."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return None
    try:
        devices = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            name = _text(nvml.nvmlDeviceGetName(handle))
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            devices.append(Device(index, name, uuid, int(memory.total), int(memory.free)))
        return devices
    finally:
        nvml.nvmlShutdown()


def parse_nvidia_smi(csv_text: str) -> list[Device]:
    """Devices from ``nvidia-smi --query-gpu=index,name,uuid,memory.total,memory.free
    --format=csv,noheader,nounits`` (memory in MiB)."""
    devices = []
    for number, row in enumerate(csv.reader(io.StringIO(csv_text), skipinitialspace=True), start=1):
        if not row:
            continue
        try:
            index, name, uuid, total, free = (field.strip() for field in row)
            devices.append(Device(int(index), name, uuid, int(total) * _MIB, int(free) * _MIB))
        except ValueError:
            raise ConfigError(
                f"nvidia-smi line {number} is not '{NVIDIA_SMI_QUERY}' with memory in MiB: {','.join(row)!r}"
            ) from None
    return devices


def _from_installed_nvml() -> list[Device] | None:
    try:
        import pynvml  # optional (nvidia-ml-py); imported here so that CPU hosts never need it
    except ImportError:
        return None
    return devices_from_nvml(pynvml)


def _from_nvidia_smi() -> list[Device]:
    """The devices nvidia-smi lists; none when it is absent or fails (no driver, as in most containers)."""
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return []
    command = [executable, f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"nvidia-smi did not answer within {NVIDIA_SMI_TIMEOUT_S:g} s: the driver may be hung; "
            f"fix it, or set {SIMULATE_ENV} to plan without it"
        ) from None
    return parse_nvidia_smi(done.stdout) if done.returncode == 0 else []


def _text(value: str | bytes) -> str:
    """NVML returns bytes in older pynvml releases and str in newer ones."""
    return value.decode() if isinstance(value, bytes) else value
