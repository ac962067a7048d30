"""Which workers a server runs and where: devices discovered, instances placed, specs built.

Used by the supervisor at start and by ``mpserve plan``, which prints the same layout without starting
anything. A model that does not fit its device is refused here, before any worker starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mpserve.config import ECHO_MODEL, ServerConfig
from mpserve.gpu.devices import Device, discover
from mpserve.gpu.placement import ModelRequest, Placement, plan
from mpserve.worker.spec import EngineSpec, PermitSpec, WorkerSpec


@dataclass(frozen=True)
class Layout:
    devices: list[Device]
    placements: list[Placement]  # in worker-index order


def build_layout(config: ServerConfig) -> Layout:
    devices = discover(config.gpus, config.simulate_gpus)
    requests = [
        ModelRequest(name=m.name, path=m.resolved_path(), instances=m.instances, n_ctx=m.n_ctx,
                     n_gpu_layers=-1 if m.n_gpu_layers is None else m.n_gpu_layers, parallel=m.parallel,
                     devices=m.devices, memory=0 if m.path == ECHO_MODEL and m.requires_memory is None
                     else m.requires_memory)
        for m in config.models
    ]
    placements = plan(requests, devices, config.gpu_memory_budget)
    order = {(p.model, p.instance): p for p in placements}
    ordered = [order[(m.name, i)] for m in config.models for i in range(m.instances)]
    return Layout(devices, ordered)


def worker_specs(config: ServerConfig, layout: Layout, backend: str, slots_path: Path) -> list[WorkerSpec]:
    """One spec per instance; instance i owns the slot-table rows first_row .. first_row + parallel - 1."""
    by_index = {d.index: d for d in layout.devices}
    capacity = config.permit_capacity
    specs = []
    first_row = 0
    for index, placement in enumerate(layout.placements):
        model = config.model(placement.model)
        device = -1 if placement.device is None else placement.device
        gpu_layers = model.n_gpu_layers if model.n_gpu_layers is not None else (-1 if device >= 0 else 0)
        permit = None
        if device >= 0 and capacity is not None:
            permit = PermitSpec(by_index[device].key, capacity, config.lock_dir, config.permit_log)
        specs.append(WorkerSpec(
            index=index, model=model.name,
            engine=EngineSpec(path=model.resolved_path(), n_ctx=model.n_ctx, threads=config.threads_for(model),
                              n_gpu_layers=gpu_layers, parallel=model.parallel, flash_attn=model.flash_attn,
                              repack=model.repack),
            first_row=first_row,
            device=device, backend=backend, slots_path=str(slots_path), parent_pid=os.getpid(),
            idle_timeout=config.idle_timeout, lazy=config.single_active_backend, permit=permit,
            log_level=config.log_level, stream_interval=config.stream_interval,
        ))
        first_row += model.parallel
    return specs
