"""A stand-in for the ``pynvml`` module, answering from a recorded device list (tests/data/nvml-*.json):
each device has name, uuid, total and free bytes, and optionally the processes NVML lists on it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

DATA = Path(__file__).parent / "data"


class FakeNvml:
    class NVMLError(Exception):
        pass

    def __init__(self, recorded: list[dict[str, Any]], *, driver_loaded: bool = True) -> None:
        self.recorded = recorded
        self.driver_loaded = driver_loaded
        self.running = False

    @classmethod
    def load(cls, name: str) -> FakeNvml:
        return cls(json.loads((DATA / name).read_text()))

    def nvmlInit(self) -> None:
        if not self.driver_loaded:
            raise self.NVMLError("Driver Not Loaded")
        self.running = True

    def nvmlShutdown(self) -> None:
        self.running = False

    def nvmlDeviceGetCount(self) -> int:
        assert self.running
        return len(self.recorded)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict[str, Any]:
        assert self.running
        return self.recorded[index]

    def nvmlDeviceGetName(self, handle: dict[str, Any]) -> bytes:
        return handle["name"].encode()  # older pynvml releases answer bytes

    def nvmlDeviceGetUUID(self, handle: dict[str, Any]) -> str:
        return handle["uuid"]

    def nvmlDeviceGetMemoryInfo(self, handle: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(total=handle["total"], free=handle["free"], used=handle["total"] - handle["free"])

    def nvmlDeviceGetComputeRunningProcesses(self, handle: dict[str, Any]) -> list[SimpleNamespace]:
        if "processes" not in handle:
            raise self.NVMLError("Not Supported")
        return [SimpleNamespace(pid=p["pid"], usedGpuMemory=p["used"]) for p in handle["processes"]]
