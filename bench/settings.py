"""What one bench run was asked to do, shared by every section."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .load import Workload


@dataclass(frozen=True)
class Settings:
    quick: bool
    repeat: int
    model: Path
    llama_server: str | None  # a llama-server binary, or None to leave it out
    work: Workload
    cores: int

    @classmethod
    def make(cls, *, quick: bool, repeat: int, model: Path, llama_server: str | None) -> Settings:
        work = Workload(max_tokens=8, n_ctx=512, min_requests=4, budget_s=5.0) if quick else \
            Workload(max_tokens=32, n_ctx=512, min_requests=8, budget_s=20.0)
        return cls(quick, repeat, model, llama_server, work, len(os.sched_getaffinity(0)))

    def threads_for(self, instances: int) -> int:
        """Threads per instance: cores ÷ instances, at least 1 (mpserve's own default)."""
        return max(1, self.cores // instances)

    def pick(self, quick: int, full: int) -> int:
        return quick if self.quick else full
