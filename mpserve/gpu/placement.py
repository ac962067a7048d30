"""How much GPU memory a model needs, and which device each model instance goes to.

Pure functions: ``estimate_model_memory`` reads a GGUF header (``mpserve.models.gguf_header``: the metadata and
tensor sizes, not the vocabulary), ``plan`` places instances on devices and refuses what does not fit,
``place_one`` places one more beside the running ones (scaling up), ``format_plan`` prints the result for
``mpserve plan``. ``estimate_host_memory`` is the same estimate for an instance on the CPU, in host RAM
(``mpserve.server.host_ram`` checks it).

The estimate follows how llama.cpp fills a GPU: the last ``n_gpu_layers`` repeating blocks, the
output layer once every block is offloaded (``n_gpu_layers`` of -1 or at least the block count),
the KV cache of the offloaded layers (``parallel`` × ``n_ctx`` cells, each K and V element in the bytes
of its ``cache_type_k`` / ``cache_type_v``), and a fixed allowance for the CUDA context and compute
buffers. A draft model (``speculative: {type: draft}``) adds its own estimate, weights and KV cache by the
same rules (f16 cells, as the engine makes them), but not its weights again when the draft is the model's
own file (the engine loads it once). It is an estimate; a declared ``requires.memory`` overrides it.
``check_kv_types`` refuses, at start, KV types whose blocks do not divide the model's heads.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from os import PathLike
from typing import TYPE_CHECKING, Any

from mpserve.config.kv_types import DEFAULT_KV_TYPE, KV_TYPES, check_head_size
from mpserve.errors import ConfigError, ModelDoesNotFit

from .devices import Device, format_memory

if TYPE_CHECKING:
    from mpserve.models.gguf_header import GGUFHeader

OVERHEAD = 512 << 20
"""CUDA context (about 300 MiB per process) plus llama.cpp compute buffers; a rough allowance."""

CPU_OVERHEAD = 128 << 20
"""llama.cpp's CPU compute and output buffers plus the worker process itself (Python, its modules); a rough
allowance, as OVERHEAD is for a GPU."""

_BLOCK = re.compile(r"blk\.(\d+)\.")
_ATTENTION_KEYS = frozenset({"embedding_length", "block_count", "attention.head_count", "attention.head_count_kv",
                             "attention.key_length", "attention.value_length"})  # after "ARCH."


@dataclass(frozen=True)
class MemoryEstimate:
    """GPU bytes one model instance needs."""

    weights: int
    kv_cache: int
    overhead: int
    draft: int = 0  # a draft model's weights and KV cache
    adapters: int = 0  # the LoRA adapters' tensors
    projector: int = 0  # the image projector's tensors (mmproj)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.overhead + self.draft + self.adapters + self.projector


@dataclass(frozen=True)
class ModelRequest:
    name: str
    path: str
    instances: int
    n_ctx: int
    n_gpu_layers: int  # -1: all
    parallel: int
    devices: tuple[int, ...] | None  # None: any device
    memory: int | None  # declared requires.memory in bytes; overrides the estimate
    gpus: int = 1
    cache_type_k: str = DEFAULT_KV_TYPE
    cache_type_v: str = DEFAULT_KV_TYPE
    draft: str | None = None  # the draft model's GGUF file (speculative decoding); None: none
    adapters: tuple[str, ...] = ()  # the LoRA adapters' GGUF files
    mmproj: str | None = None  # the image projector's GGUF file; None: none


@dataclass(frozen=True)
class Placement:
    model: str
    instance: int
    device: int | None  # None: CPU
    memory: int  # bytes planned on the device; 0 on CPU
    draft: int = 0  # of those, the draft model's (estimated)


Estimator = Callable[[ModelRequest], MemoryEstimate]


@dataclass(frozen=True)
class _Attention:
    """What the KV cache's size depends on, from the GGUF metadata."""

    n_layer: int
    n_head_kv: int
    key_length: int
    value_length: int


def estimate_model_memory(
    gguf_path: str | PathLike[str], n_ctx: int, n_gpu_layers: int, parallel: int = 1,
    cache_type_k: str = DEFAULT_KV_TYPE, cache_type_v: str = DEFAULT_KV_TYPE,
) -> MemoryEstimate:
    reader = _read(gguf_path)
    attention = _attention(reader, gguf_path)
    n_layer = attention.n_layer

    all_offloaded = n_gpu_layers < 0 or n_gpu_layers >= n_layer
    offloaded = n_layer if all_offloaded else n_gpu_layers
    first_on_gpu = n_layer - offloaded
    names = {tensor.name for tensor in reader.tensors}
    output_names = {name for name in names if name.startswith("output")}
    if "output.weight" not in names:
        output_names.add("token_embd.weight")  # tied embeddings: the output layer reuses them

    weights = 0
    for tensor in reader.tensors:
        block = _BLOCK.match(tensor.name)
        on_gpu = int(block.group(1)) >= first_on_gpu if block else all_offloaded and tensor.name in output_names
        weights += int(tensor.n_bytes) if on_gpu else 0
    per_cell = attention.n_head_kv * (attention.key_length * KV_TYPES[cache_type_k].bytes_per_element
                                      + attention.value_length * KV_TYPES[cache_type_v].bytes_per_element)
    kv_cache = int(offloaded * n_ctx * parallel * per_cell)
    return MemoryEstimate(weights, kv_cache, OVERHEAD)


def estimate_request(model: ModelRequest) -> MemoryEstimate:
    """``estimate_model_memory`` with a model's settings, its adapters' and its draft model's added."""
    estimate = estimate_model_memory(model.path, model.n_ctx, model.n_gpu_layers, model.parallel,
                                     model.cache_type_k, model.cache_type_v)
    estimate = replace(estimate, adapters=sum(sum(t.n_bytes for t in _read(a).tensors) for a in model.adapters),
                       projector=sum(t.n_bytes for t in _read(model.mmproj).tensors) if model.mmproj else 0)
    if model.draft is None:
        return estimate
    draft = estimate_model_memory(model.draft, model.n_ctx, model.n_gpu_layers, model.parallel)
    shared = os.path.realpath(model.draft) == os.path.realpath(model.path)
    return replace(estimate, draft=(0 if shared else draft.weights) + draft.kv_cache)


def estimate_host_memory(model: ModelRequest) -> MemoryEstimate:
    """Host RAM one instance of ``model`` needs running on the CPU: every tensor (the token embeddings too),
    the KV cache of every layer, ``CPU_OVERHEAD``, and a draft model's weights and KV cache as ``estimate_request``
    counts them."""
    on_gpu = estimate_request(replace(model, n_gpu_layers=-1))  # the KV cache and the draft: as all on a device
    weights = sum(int(tensor.n_bytes) for tensor in _read(model.path).tensors)
    return MemoryEstimate(weights, on_gpu.kv_cache, CPU_OVERHEAD, on_gpu.draft, on_gpu.adapters, on_gpu.projector)


def check_kv_types(name: str, gguf_path: str | PathLike[str], cache_type_k: str, cache_type_v: str) -> None:
    """``ConfigError`` when a quantized KV type's blocks do not divide the model's K or V heads (llama.cpp would
    refuse to create the context)."""
    if not (KV_TYPES[cache_type_k].quantized or KV_TYPES[cache_type_v].quantized):
        return
    attention = _attention(_read(gguf_path), gguf_path)
    for kind, type_name, head_size in (("K", cache_type_k, attention.key_length),
                                       ("V", cache_type_v, attention.value_length)):
        problem = check_head_size(kind, type_name, head_size)
        if problem is not None:
            raise ConfigError(f"model {name!r}: {problem}")


def _read(gguf_path: str | PathLike[str]) -> GGUFHeader:
    # imported here: the reader needs gguf and numpy, and a server on CPUs with the default KV types never
    # reads a header, so its start (and every test's) does not pay for importing them
    from mpserve.models.gguf_header import read_header

    try:
        return read_header(gguf_path, _estimate_needs)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read model {gguf_path} as GGUF: {exc}") from exc


def _estimate_needs(key: str) -> bool:
    """Whether the estimate reads metadata ``key``: the architecture, and its keys that ``_attention`` reads."""
    return key == "general.architecture" or key.partition(".")[2] in _ATTENTION_KEYS


def _attention(reader: GGUFHeader, gguf_path: object) -> _Attention:
    arch = str(_metadata(reader, gguf_path, "general.architecture"))
    n_embd = int(_metadata(reader, gguf_path, f"{arch}.embedding_length"))
    n_head = _largest(_metadata(reader, gguf_path, f"{arch}.attention.head_count"))
    return _Attention(
        n_layer=int(_metadata(reader, gguf_path, f"{arch}.block_count")),
        n_head_kv=_largest(_metadata(reader, gguf_path, f"{arch}.attention.head_count_kv", n_head)),
        key_length=int(_metadata(reader, gguf_path, f"{arch}.attention.key_length", n_embd // n_head)),
        value_length=int(_metadata(reader, gguf_path, f"{arch}.attention.value_length", n_embd // n_head)),
    )


def plan(
    models: Sequence[ModelRequest],
    devices: Sequence[Device],
    budget: int | None = None,
    estimate: Estimator = estimate_request,
    single_active: bool = False,
) -> list[Placement]:
    """Place every instance, round robin over each model's allowed devices, within free memory.

    A device offers its free memory, or ``budget`` if smaller. The round robin runs across models,
    so single-instance models spread too; an instance skips devices that are already full. With no
    devices everything runs on the CPU, unchecked. ``ModelDoesNotFit`` when an instance fits nowhere.
    ``single_active`` (single active backend): one model at a time is resident on a device, so an instance
    needs room beside its own model's instances there, not beside every model's.
    """
    if not devices:
        return [Placement(model.name, instance, None, 0) for model in models for instance in range(model.instances)]
    order = [device.index for device in devices]
    room = {d.index: d.memory_free if budget is None else min(d.memory_free, budget) for d in devices}
    placements: list[Placement] = []
    cursor = 0
    for model in models:
        allowed = _allowed_devices(model, order)
        need, estimated = _need(model, estimate)
        draft = estimated.draft if estimated is not None else 0
        for instance in range(model.instances):
            planned = _planned(placements, order, model.name if single_active else None)
            turn = order[cursor:] + order[:cursor]
            candidates = [index for index in turn if index in allowed]
            chosen = next((index for index in candidates if room[index] - planned[index] >= need), None)
            if chosen is None:
                roomiest = max(candidates, key=lambda index: room[index] - planned[index])
                device = devices[order.index(roomiest)]
                raise ModelDoesNotFit(_does_not_fit(model, instance, need, estimated, device, room, planned, budget))
            placements.append(Placement(model.name, instance, chosen, need, draft))
            cursor = (order.index(chosen) + 1) % len(order)
    return placements


def _planned(placements: Sequence[Placement], order: Sequence[int], model: str | None) -> dict[int, int]:
    """The memory planned on each device: every instance's, or only ``model``'s instances' (single active
    backend, where the other models are not resident beside it)."""
    return {index: sum(p.memory for p in placements if p.device == index and model in (None, p.model))
            for index in order}


def place_one(
    model: ModelRequest,
    instance: int,
    live: Sequence[Placement],
    devices: Sequence[Device],
    budget: int | None = None,
    estimate: Estimator = estimate_request,
    single_active: bool = False,
) -> Placement:
    """One more instance of ``model`` beside the ``live`` instances of every model (of ``model`` alone with
    ``single_active``), by ``plan``'s rules: the allowed device with the most room left goes first;
    ``ModelDoesNotFit`` when none has room."""
    if not devices:
        return Placement(model.name, instance, None, 0)
    order = [device.index for device in devices]
    allowed = _allowed_devices(model, order)
    need, estimated = _need(model, estimate)
    draft = estimated.draft if estimated is not None else 0
    room = {d.index: d.memory_free if budget is None else min(d.memory_free, budget) for d in devices}
    planned = _planned(live, order, model.name if single_active else None)
    roomiest = max((index for index in order if index in allowed), key=lambda index: room[index] - planned[index])
    if room[roomiest] - planned[roomiest] < need:
        device = devices[order.index(roomiest)]
        raise ModelDoesNotFit(_does_not_fit(model, instance, need, estimated, device, room, planned, budget))
    return Placement(model.name, instance, roomiest, need, draft)


def _need(model: ModelRequest, estimate: Estimator) -> tuple[int, MemoryEstimate | None]:
    """The bytes one instance of ``model`` is planned with (declared, else estimated), and the estimate's parts
    (None where declared)."""
    if model.memory is not None:
        return model.memory, None
    estimated = estimate(model)
    return estimated.total, estimated


def format_plan(placements: Sequence[Placement], devices: Sequence[Device], single_active: bool = False) -> str:
    """One row per instance, then each device's planned total against its free memory: with ``single_active``,
    the most any one model's instances there need (only one model is resident at a time)."""
    by_index = {device.index: device for device in devices}
    rows = [("MODEL", "INSTANCE", "DEVICE", "MEMORY")]
    for placement in placements:
        if placement.device is None:
            rows.append((placement.model, str(placement.instance), "CPU", "-"))
        else:
            where = _device_label(by_index[placement.device])
            memory = format_memory(placement.memory)
            if placement.draft:
                memory += f" (draft model {format_memory(placement.draft)})"
            rows.append((placement.model, str(placement.instance), where, memory))
    widths = [max(len(row[column]) for row in rows) for column in range(3)]  # the last column is not padded
    lines = ["  ".join([*(row[column].ljust(width) for column, width in enumerate(widths)), row[3]]) for row in rows]
    if devices:
        lines.append("")
    for device in devices:
        here = [p for p in placements if p.device == device.index]
        by_model = Counter[str]()
        for p in here:
            by_model[p.model] += p.memory
        total = max(by_model.values(), default=0) if single_active else sum(by_model.values())
        label = _device_label(device)
        largest = (f" (single active backend: the largest of {len(by_model)} models, one resident at a time)"
                   if single_active and len(by_model) > 1 else "")
        lines.append(f"{label}: {format_memory(total)} planned of {format_memory(device.memory_free)} free{largest}")
    return "\n".join(lines)


def _allowed_devices(model: ModelRequest, order: list[int]) -> set[int]:
    if model.gpus != 1:
        raise ConfigError(f"model {model.name!r} asks for {model.gpus} GPUs per instance; only 1 is supported")
    if model.devices is None:
        return set(order)
    missing = sorted(set(model.devices) - set(order))
    if missing:
        raise ConfigError(
            f"model {model.name!r} is pinned to GPU {', '.join(map(str, missing))}, "
            f"which this host does not have (it has GPU {', '.join(map(str, order))})"
        )
    return set(model.devices)


def _does_not_fit(
    model: ModelRequest,
    instance: int,
    need: int,
    estimated: MemoryEstimate | None,
    device: Device,
    room: dict[int, int],
    planned: dict[int, int],
    budget: int | None,
) -> str:
    offered = "free" if budget is None or budget >= device.memory_free else "budget"
    available = room[device.index] - planned[device.index]
    if estimated is not None:
        kv = f"KV cache {format_memory(estimated.kv_cache)} for parallel {model.parallel} × n_ctx {model.n_ctx}"
        source = (f"estimated: weights {format_memory(estimated.weights)} + {kv} + overhead "
                  f"{format_memory(estimated.overhead + estimated.draft)}")
        context = f"a smaller parallel (now {model.parallel}) or n_ctx (now {model.n_ctx})"
        layers = f"fewer n_gpu_layers (now {model.n_gpu_layers})"
        hint = f"{context}, {layers}" if estimated.kv_cache > estimated.weights else f"{layers}, {context}"
    else:
        source = "declared requires.memory"
        hint = "a smaller requires.memory if it overstates the need"
    return (
        f"model {model.name!r} instance {instance} needs {format_memory(need)} ({source}) but "
        f"{_device_label(device)} has {format_memory(available)} available "
        f"({format_memory(room[device.index])} {offered}, {format_memory(planned[device.index])} "
        f"planned for other instances), and no allowed device has more; try {hint}, "
        "fewer instances, or another device"
    )


def _device_label(device: Device) -> str:
    return f"GPU {device.index} ({device.name})"


_MISSING = object()


def _metadata(reader: GGUFHeader, path: object, key: str, default: Any = _MISSING) -> Any:
    """A metadata value: str, int, or a list of ints for per-layer arrays."""
    if key not in reader.metadata:
        if default is _MISSING:
            raise ConfigError(f"model {path} lacks GGUF metadata {key!r}, needed to estimate its memory")
        return default
    return reader.metadata[key]


def _largest(value: int | list[int]) -> int:
    """Per-layer head counts (a list in some architectures) sized by their largest entry."""
    return max(value) if isinstance(value, list) else int(value)
