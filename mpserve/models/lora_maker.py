"""Deterministic random LoRA adapters for a given base GGUF, written as GGUF adapter files.

No adapter can be downloaded where mpserve is tested, so it writes its own, for any base model (the built-in
random ones, Gemma 3 270M, ...):

    base.gguf ──read_header──▶ its architecture and the shapes of its attention and feed-forward matrices
              ──RandomState(seed), in the base's tensor order──▶ per matrix W (ne = [n_in, n_out]):
                  W.lora_a (ne = [n_in, rank]) and W.lora_b (ne = [rank, n_out])
              ──gguf.GGUFWriter──▶ adapter.gguf: general.type "adapter", adapter.type "lora",
                                   adapter.lora.alpha = rank (so llama.cpp's scale is the scale asked for)

The format is the one llama.cpp's ``convert_lora_to_gguf.py`` writes and ``llama_adapter_lora_init`` reads: the
delta of ``W`` is ``scale * alpha / rank * B @ A``. ``A`` is drawn with rows of unit norm and ``B`` scaled by
``GAIN``, so the delta moves a matrix's output by about ``GAIN`` times its input's size: enough to change a model's
greedy choices, not so much that it only says one thing. Row 0 of the delta of the matrices that add into the
residual stream (``attn_output``, ``ffn_down``) is zero: the built-in models keep residual dimension 0 constant
(``mpserve.models.maker``), which keeps their output printable, and a real model loses nothing it needs.

Same arguments (the base file's bytes included), same bytes: the writer adds nothing time- or host-dependent.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np

from mpserve.errors import ConfigError

from .gguf_header import TensorInfo, read_header
from .maker import finish, write_atomically

MAX_RANK = 256
GAIN = 0.25
TARGETS = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight")
"""The base matrices an adapter changes: each block's attention and feed-forward projections."""
WRITES_RESIDUAL = ("attn_output", "ffn_down")


def write_lora(path: str | os.PathLike[str], base: str | os.PathLike[str], seed: int = 0, rank: int = 8) -> Path:
    """Write a random LoRA adapter of ``rank`` for the base GGUF ``base`` to ``path`` atomically (a temporary file
    moved into place) and return the path. ConfigError when ``base`` is not a model GGUF with matrices to adapt."""
    if not 1 <= rank <= MAX_RANK:
        raise ConfigError(f"--rank {rank}: give a rank from 1 to {MAX_RANK}")
    try:
        header = read_header(base, lambda key: key in ("general.architecture", "general.type"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--lora-for {base}: cannot read it as a GGUF model ({exc}); give the model's GGUF "
                          "file") from None
    arch = header.metadata.get("general.architecture")
    if not isinstance(arch, str) or header.metadata.get("general.type", "model") != "model":
        raise ConfigError(f"--lora-for {base} is not a model GGUF; give the GGUF of the model the adapter is for")
    targets = [t for t in header.tensors if TARGETS.fullmatch(t.name) and len(t.shape) == 2]
    if not targets:
        raise ConfigError(f"--lora-for {base} has no attention or feed-forward matrices (blk.N.attn_q.weight, ...) "
                          "to adapt")
    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(tmp, arch)
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_name(f"mpserve-lora-{Path(base).stem}-seed{seed}-rank{rank}")
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank))
        for name, tensor in _pairs(targets, seed, rank):
            writer.add_tensor(name, tensor)
        finish(writer)

    return write_atomically(Path(path), write)


def _pairs(targets: list[TensorInfo], seed: int, rank: int) -> Iterator[tuple[str, np.ndarray]]:
    """``lora_a`` and ``lora_b`` of each target, in the base's order, drawn from one RandomState in that order.
    Shapes in numpy order (ggml's ``ne`` reversed)."""
    rng = np.random.RandomState(seed)
    for info in targets:
        n_in, n_out = info.shape
        a = rng.standard_normal((rank, n_in)) / np.sqrt(n_in)
        b = rng.standard_normal((n_out, rank)) * (GAIN / np.sqrt(rank))
        if info.name.split(".")[2] in WRITES_RESIDUAL:
            b[0, :] = 0.0
        yield f"{info.name}.lora_a", a.astype(np.float32)
        yield f"{info.name}.lora_b", b.astype(np.float32)
