"""A LoRA adapter GGUF checked against the model it is meant for, from the two files' headers alone.

    adapter.gguf ──read_header──▶ general.type "adapter", adapter.type "lora", adapter.lora.alpha,
                                  general.architecture, tensors ``W.lora_a`` / ``W.lora_b``
    base.gguf    ──read_header──▶ its architecture and tensor shapes
                 ──check_adapter──▶ LoraInfo (rank, alpha, bytes), or BadRequest: one line naming what is wrong
                                    and what to give instead

llama.cpp's ``llama_adapter_lora_init`` makes the same checks, but says why only in its log and hands back a null
pointer; checked here first, a bad adapter is refused with its reason (at start, and by a runtime load). The
format is the one llama.cpp's ``convert_lora_to_gguf.py`` writes (``mpserve.models.lora_maker`` writes random
ones): for a base matrix ``W`` with ggml shape ``ne = [n_in, n_out]``, ``W.lora_a`` has ``[n_in, rank]`` and
``W.lora_b`` ``[rank, n_out]`` (the token embeddings' pair the other way round).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mpserve.errors import BadRequest

from .gguf_header import GGUFHeader, read_header

MAKE_ONE = ("(`mpserve make-model A.gguf --lora-for BASE.gguf` writes a random one; llama.cpp's "
            "convert_lora_to_gguf.py converts a PEFT adapter)")
_KEYS = ("general.architecture", "general.type", "adapter.type", "adapter.lora.alpha")


@dataclass(frozen=True)
class LoraInfo:
    path: str
    architecture: str
    alpha: float
    rank: int  # the largest of its pairs'
    tensors: int  # matrices it changes
    n_bytes: int  # its tensors' bytes: what loading it costs the host (once, when loaded before the fork)


def check_adapter(name: str, path: str | os.PathLike[str], base: str | os.PathLike[str]) -> LoraInfo:
    """``path`` as a LoRA adapter for the model GGUF ``base``, or BadRequest naming adapter ``name``'s problem."""
    where = f"adapter {name!r} ({path})"
    if not Path(path).is_file():
        raise BadRequest(f"{where}: no such file; give the path of a LoRA adapter GGUF {MAKE_ONE}")
    adapter = _header(where, path)
    kind, lora = adapter.metadata.get("general.type", "model"), adapter.metadata.get("adapter.type")
    if kind != "adapter" or lora != "lora":
        what = f"a {kind} GGUF" if kind != "adapter" else f"an adapter of type {lora!r}"
        raise BadRequest(f"{where} is {what}, not a LoRA adapter; give a LoRA adapter GGUF {MAKE_ONE}")
    model = _header(f"the base model ({base})", base)
    arch, base_arch = adapter.metadata.get("general.architecture"), model.metadata.get("general.architecture")
    if arch != base_arch:
        raise BadRequest(f"{where} adapts a {arch!r} model, and this model is {base_arch!r}: give an adapter made "
                         "for this model")
    shapes = {t.name: t.shape for t in model.tensors}
    pairs = {t.name: t.shape for t in adapter.tensors}
    rank = 0
    for tensor in sorted(pairs):
        target, _, part = tensor.rpartition(".")
        if part not in ("lora_a", "lora_b"):
            raise BadRequest(f"{where}: tensor {tensor!r} is not a LoRA pair's (.lora_a, .lora_b); give a LoRA "
                             f"adapter GGUF {MAKE_ONE}")
        if part == "lora_b":
            continue
        a, b = pairs[tensor], pairs.get(f"{target}.lora_b")
        if b is None or target not in shapes or len(a) != 2 or len(b) != 2:
            missing = "its .lora_b" if b is None else "a 2-D tensor in the model" if target in shapes else "no tensor"
            raise BadRequest(f"{where}: {tensor!r} has {missing} of that name: the adapter was made for another model"
                             "; give one made for this model")
        base_shape = shapes[target]
        expected = ((base_shape[0], a[1]), (a[1], base_shape[1]))
        if target.endswith("token_embd.weight"):  # llama.cpp's token-embedding pair is the other way round
            expected = ((a[0], base_shape[1]), (a[0], base_shape[0]))
        if (a, b) != expected:
            raise BadRequest(f"{where}: {target!r} pair has shapes {list(a)} and {list(b)}, while the model's "
                             f"{target!r} is {list(base_shape)}: the adapter was made for another model of this "
                             "architecture; give one made for this model")
        rank = max(rank, b[0])
    if not rank:
        raise BadRequest(f"{where} has no LoRA tensors; give a LoRA adapter GGUF {MAKE_ONE}")
    alpha = adapter.metadata.get("adapter.lora.alpha", 0.0)
    return LoraInfo(str(path), str(arch), float(alpha) if isinstance(alpha, (int, float)) else 0.0, rank,
                    len(pairs) // 2, sum(t.n_bytes for t in adapter.tensors))


def _header(where: str, path: str | os.PathLike[str]) -> GGUFHeader:
    try:
        return read_header(path, lambda key: key in _KEYS)
    except ValueError as exc:
        raise BadRequest(f"{where}: {exc}; give a LoRA adapter GGUF {MAKE_ONE}") from None
    except OSError as exc:
        raise BadRequest(f"{where} cannot be read ({exc.strerror}); check the path and its permissions") from None
