"""Which workers a server runs and where: devices discovered, instances placed, specs built.

Used by the supervisor at start and by ``mpserve plan``, which prints the same layout without starting
anything, and by ``mpserve doctor`` (``start_modes``). A model that does not fit its device is refused here,
before any worker starts.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from mpserve.config.loader import ECHO_MODEL, ModelConfig, ServerConfig
from mpserve.config.reasoning import Reasoning
from mpserve.config.speculative import check_draft
from mpserve.errors import ConfigError
from mpserve.gpu.devices import Device, discover
from mpserve.gpu.placement import ModelRequest, Placement, check_kv_types, estimate_host_memory, plan
from mpserve.models.sources import projector_file, template_hint
from mpserve.models.templates import template_for
from mpserve.repack import repack_for
from mpserve.worker.spec import EngineSpec, PermitSpec, StartMode, WorkerSpec, start_mode

from .host_ram import RamNeed, available_ram, check_ram, format_ram


@dataclass(frozen=True)
class Layout:
    devices: list[Device]
    placements: list[Placement]  # in worker-index order


def build_layout(config: ServerConfig) -> Layout:
    """The instances started with (each model's min), placed."""
    devices = discover(config.gpus, config.simulate_gpus)
    requests = [model_request(m) for m in config.models]
    for request in requests:
        check_model(request)
    placements = plan(requests, devices, config.gpu_memory_budget, single_active=config.single_active_backend)
    order = {(p.model, p.instance): p for p in placements}
    ordered = [order[(m.name, i)] for m in config.models for i in range(m.instances)]
    return Layout(devices, ordered)


def check_host_ram(config: ServerConfig, layout: Layout) -> list[str]:
    """``ModelDoesNotFit`` when the instances placed on the CPU do not fit the host's RAM (``host_ram``); the
    warnings to log otherwise."""
    return check_ram(ram_needs(config, layout), available_ram(config.ram_budget))


def format_host_ram(config: ServerConfig, layout: Layout) -> str:
    """``mpserve plan``'s host RAM lines (none without CPU instances of a model file)."""
    return format_ram(ram_needs(config, layout), available_ram(config.ram_budget))


def ram_needs(config: ServerConfig, layout: Layout) -> list[RamNeed]:
    """Each model's instances placed on the CPU (the echo backend holds nothing), with how they hold its weights:
    shared when forked from its zygote or mapped from the file unrepacked, else a copy each."""
    on_cpu = Counter(p.model for p in layout.placements if p.device is None)
    models = [m for m in config.models if on_cpu[m.name] and m.path != ECHO_MODEL]
    if not models:
        return []
    modes = start_modes(config, layout)
    return [RamNeed(m.name, on_cpu[m.name], estimate_host_memory(model_request(m)),
                    modes[m.name].zygote or not repack_for(m), m.cache_ram, m.parallel, m.n_ctx, modes[m.name].zygote)
            for m in models]


def model_request(m: ModelConfig) -> ModelRequest:
    """What placement needs to know of a model (the echo backend needs no memory unless told)."""
    return ModelRequest(name=m.name, path=m.resolved_path(), instances=m.instances, n_ctx=m.n_ctx,
                        n_gpu_layers=-1 if m.n_gpu_layers is None else m.n_gpu_layers, parallel=m.parallel,
                        devices=m.devices, memory=0 if m.path == ECHO_MODEL and m.requires_memory is None
                        else m.requires_memory, cache_type_k=m.cache_type_k, cache_type_v=m.cache_type_v,
                        draft=m.speculative.model if m.speculative is not None and m.path != ECHO_MODEL else None,
                        adapters=tuple(m.adapter_paths().values()),
                        mmproj=projector_file(m.path, m.mmproj))


def check_model(request: ModelRequest) -> None:
    """What the GGUF's shape refuses of a model's settings (its KV types, a draft model with another
    vocabulary), before anything starts."""
    if request.path == ECHO_MODEL:
        return
    check_kv_types(request.name, request.path, request.cache_type_k, request.cache_type_v)
    if request.draft is not None and os.path.realpath(request.draft) != os.path.realpath(request.path):
        try:
            check_draft(request.name, request.path, request.draft)
        except ValueError as exc:
            raise ConfigError(f"{exc}; give a draft model made from the same tokenizer") from None


def worker_specs(config: ServerConfig, layout: Layout, backend: str, slots_path: Path) -> list[WorkerSpec]:
    """One spec per placed instance, at the index and rows ``instance_rows`` keeps for it. Every model's repacking
    is decided here, before the server's loop runs, placed or not: a model that starts at zero would otherwise
    run the host's repack probe (seconds, in a child) inside the loop when its first request comes, and the
    loop would answer nobody meanwhile."""
    for model in config.models:
        repack_for(model)
    rows = instance_rows(config)
    return [worker_spec(config, layout.devices, placement, *rows[placement.model][placement.instance], backend,
                        slots_path) for placement in layout.placements]


def start_modes(config: ServerConfig, layout: Layout) -> dict[str, StartMode]:
    """How each model's instances start, judged on its first instance as placed (one started with none: on the
    first GPU where there are GPUs, as a scale-up would try first)."""
    first = {p.model: p for p in reversed(layout.placements)}
    modes = {}
    for model in config.models:
        device = layout.devices[0].index if layout.devices else None
        placement = first.get(model.name, Placement(model.name, 0, device, 0))
        modes[model.name] = start_mode(worker_spec(config, layout.devices, placement, 0, 0, "", Path()),
                                       config.start_method)
    return modes


def instance_rows(config: ServerConfig) -> dict[str, list[tuple[int, int]]]:
    """(worker index, first slot-table row) for each of every model's max instances, model by model: instance
    i of a model owns rows first_row .. first_row + parallel - 1, started or not."""
    rows: dict[str, list[tuple[int, int]]] = {}
    index = first_row = 0
    for model in config.models:
        rows[model.name] = []
        for _ in range(model.bounds[1]):
            rows[model.name].append((index, first_row))
            index, first_row = index + 1, first_row + model.parallel
    return rows


def chat_template(model: ModelConfig) -> str | None:
    """The template the model's instances serve (``mpserve.models.templates``); the echo backend has none."""
    if model.path == ECHO_MODEL or model.embedding:
        return None
    return template_for(model.chat_template, model.resolved_path(), template_hint(model.path))


def served_template(model: ModelConfig) -> str | None:
    """The text of the template the model's instances serve (``chat_template``, else the GGUF's own, read from its
    header as llama.cpp reads it), which a remote pool's must equal (``mpserve.server.chat``); None where the
    server cannot tell: the echo backend, an embedding model, a header this reader cannot follow."""
    from mpserve.models.gguf_header import read_header  # numpy and gguf: imported late, as placement does

    chosen = chat_template(model)
    if chosen is not None or model.path == ECHO_MODEL or model.embedding:
        return chosen
    try:
        key = "tokenizer.chat_template"
        own = read_header(model.resolved_path(), key.__eq__).metadata.get(key, "")
    except (ValueError, OSError):
        return None
    return own if isinstance(own, str) else None


def served_chat(model: ModelConfig) -> tuple[str | None, str | None]:
    """What ``Tables.serve_chat`` takes: ``served_template``, and ``eos_text`` of it where there is one."""
    template = served_template(model)
    return template, eos_text(model, template) if template is not None else None


def eos_text(model: ModelConfig, template: str) -> str | None:
    """The EOS token's text the gateways need to render ``template`` before any instance has loaded ``model`` and
    told its own (STATS): "" where the template does not refer to it (its BOS renders empty everywhere:
    ``mpserve.gateway.api.chat``), else read from the GGUF as llama.cpp reads it (``tokenizer.ggml.eos_token_id``
    into its tokens); None where the GGUF does not say it (until an instance tells, the gateways then render the
    ChatML default)."""
    if "eos_token" not in template:
        return ""
    from mpserve.models.gguf_header import read_header

    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.tokens")
    try:
        metadata = read_header(model.resolved_path(), keys.__contains__).metadata
    except (ValueError, OSError):
        return None
    eos, tokens = metadata.get(keys[0]), metadata.get(keys[1])
    if not isinstance(eos, int) or not isinstance(tokens, list) or not 0 <= eos < len(tokens):
        return None
    return str(tokens[eos])


def worker_spec(config: ServerConfig, devices: list[Device], placement: Placement, index: int, first_row: int,
                backend: str, slots_path: Path) -> WorkerSpec:
    model = config.model(placement.model)
    device = -1 if placement.device is None else placement.device
    gpu_layers = model.n_gpu_layers if model.n_gpu_layers is not None else (-1 if device >= 0 else 0)
    permit = None
    capacity = config.permit_capacity
    if device >= 0 and capacity is not None:
        key = next(d.key for d in devices if d.index == device)
        permit = PermitSpec(key, capacity, config.lock_dir, config.permit_log)
    return WorkerSpec(
        index=index, model=model.name,
        engine=EngineSpec(path=model.resolved_path(), n_ctx=model.n_ctx, threads=config.threads_for(model),
                          n_gpu_layers=gpu_layers, parallel=model.parallel, flash_attn=model.flash_attn,
                          repack=repack_for(model), echo_tick_s=model.echo_tick_ms / 1000, embedding=model.embedding,
                          pooling=model.pooling, speculative=model.speculative,
                          reasoning=model.reasoning or Reasoning(),
                          cache_type_k=model.cache_type_k, cache_type_v=model.cache_type_v, cache_ram=model.cache_ram,
                          cache_shm=model.store_dir(), cache_disk=model.cache_disk,
                          cache_disk_size=model.cache_disk_size, cache_remote=model.remote_tier(),
                          chat_template=chat_template(model),
                          reuse=model.reuse, adapters=model.adapter_paths(),
                          mmproj=projector_file(model.path, model.mmproj)),
        first_row=first_row,
        device=device, backend=backend, slots_path=str(slots_path), parent_pid=os.getpid(),
        idle_timeout=config.idle_timeout, lazy=config.single_active_backend, permit=permit,
        log_level=config.log_level, stream_interval=config.stream_interval, slot_save_path=model.slot_save_path,
        adopt_wait=config.adopt_wait, adapter_dir=model.adapter_dir, kv_events=config.kv_events or "",
    )
