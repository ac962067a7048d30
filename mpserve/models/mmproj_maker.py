"""Deterministic random image projectors for the built-in models, written as GGUF files llama.cpp's ``clip`` loader
reads (``mpserve make-model vision.gguf --size tiny --mmproj mmproj.gguf``).

No vision model can be downloaded where mpserve is tested, so it writes its own: a LLaVA-style pair, the text model of
a built-in size and a projector of llama.cpp's ``mlp`` type (the simplest its loader supports) whose output width is
that model's ``n_embd``:

    RGB image ──mtmd: resized to IMAGE_SIZE², normalized (image_mean, image_std)──▶ v.patch_embd (a conv of
    PATCH_SIZE) + v.position_embd ──▶ VISION_LAYERS ViT blocks (v.blk.N: ln1, attn_q/k/v/out, ln2, ffn_up/down)
    ──▶ mm.0 (a linear map) ─▶ GELU ─▶ mm.2 (a linear map to n_embd) ──▶ one embedding per patch: TOKENS_PER_IMAGE
    positions of the text model's prompt

llama.cpp's LLaVA graph runs the blocks before the last one (its feature layer is the second to last), so the last
block's weights are read but not used, as with LLaVA 1.5. Row 0 of ``mm.2`` is zero and its bias 1: an image's
embeddings hold the built-in models' residual constant in dimension 0, as their token embeddings do
(``mpserve.models.maker``), and ``mm.2`` is scaled so the embeddings' size is the token embeddings' own: an image
moves the text that follows it as much as the tokens it stands in for would.

Same arguments, same bytes: weights come from ``numpy.random.RandomState(PROJECTOR_SEED)`` drawn in file order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import numpy as np

from .maker import finish, write_atomically
from .shapes import ModelShape, shape_for

IMAGE_SIZE = 56
PATCH_SIZE = 14
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2
VISION_EMBD = 32
VISION_FF = 48  # not VISION_EMBD: llama.cpp takes ffn_down of width n_embd for an old file's swapped up and down
VISION_HEADS = 2
VISION_LAYERS = 2
PROJECTOR_HIDDEN = 64
PROJECTOR_SEED = 7
_LN_EPS = 1e-6
_EMBEDDING_GAIN = 3.0  # mm.2's scale: the embeddings come out about as large as the token embeddings


def write_projector(path: str | os.PathLike[str], size: str = "tiny", hidden: int = PROJECTOR_HIDDEN) -> Path:
    """Write the projector of the built-in ``size`` model to ``path`` atomically and return the path. ``hidden``: the
    width of its MLP (``mm.0``'s outputs), which sets its weights' size: (VISION_EMBD + n_embd + 1) × 4 bytes each."""
    shape = shape_for(size)
    return write_atomically(Path(path), lambda tmp: _write(tmp, f"mpserve-{size}-mmproj", shape, hidden))


def _write(path: Path, name: str, shape: ModelShape, hidden: int) -> None:
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_name(name)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    writer.add_uint32("clip.vision.patch_size", PATCH_SIZE)
    writer.add_uint32("clip.vision.embedding_length", VISION_EMBD)
    writer.add_uint32("clip.vision.feed_forward_length", VISION_FF)
    writer.add_uint32("clip.vision.block_count", VISION_LAYERS)
    writer.add_uint32("clip.vision.projection_dim", shape.n_embd)
    writer.add_uint32("clip.vision.attention.head_count", VISION_HEADS)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", _LN_EPS)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    for tensor_name, tensor in _weights(shape.n_embd, hidden):
        writer.add_tensor(tensor_name, tensor)
    finish(writer)


def _weights(n_embd: int, hidden: int) -> Iterator[tuple[str, np.ndarray]]:
    """All tensors in file order (numpy's shapes: ggml's ``ne`` reversed), drawn from one RandomState in that order."""
    rng = np.random.RandomState(PROJECTOR_SEED)

    def matrix(n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        weight: np.ndarray = (rng.standard_normal((n_out, n_in)) * (gain / np.sqrt(n_in))).astype(np.float32)
        return weight

    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.float32)

    fan_in = 3 * PATCH_SIZE * PATCH_SIZE
    patch = rng.standard_normal((VISION_EMBD, 3, PATCH_SIZE, PATCH_SIZE)) / np.sqrt(fan_in)
    yield "v.patch_embd.weight", patch.astype(np.float16)  # a convolution's kernel, f16 as converted models have it
    yield "v.patch_embd.bias", zeros(VISION_EMBD)
    yield "v.position_embd.weight", matrix(TOKENS_PER_IMAGE, VISION_EMBD)
    for layer in range(VISION_LAYERS):
        yield from encoder_block(f"v.blk.{layer}", VISION_EMBD, VISION_FF, matrix)
    yield "mm.0.weight", matrix(hidden, VISION_EMBD)
    yield "mm.0.bias", zeros(hidden)
    yield from zip(("mm.2.weight", "mm.2.bias"), output_map(matrix(n_embd, hidden, _EMBEDDING_GAIN)), strict=True)


def output_map(out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A projector's last linear map, to the text model's width, and its bias: row 0 zero and its bias 1, so that
    dimension 0 of every embedding it makes is the built-in models' residual constant."""
    out[0, :] = 0.0
    bias = np.zeros(out.shape[0], dtype=np.float32)
    bias[0] = 1.0
    return out, bias


def encoder_block(block: str, n_embd: int, n_ff: int, matrix: Callable[[int, int], np.ndarray],
                  key_bias: bool = True) -> Iterator[tuple[str, np.ndarray]]:
    """One transformer block of an encoder as llama.cpp's ``clip`` names it (ln1, attn_q/k/v/out, ln2, ffn_up/down;
    without ``key_bias``, Whisper's, no bias for attn_k), its weights drawn by ``matrix`` in file order."""
    for norm in ("ln1", "ln2"):
        yield f"{block}.{norm}.weight", np.ones(n_embd, dtype=np.float32)
        yield f"{block}.{norm}.bias", np.zeros(n_embd, dtype=np.float32)
    for attention in ("attn_q", "attn_k", "attn_v", "attn_out"):
        yield f"{block}.{attention}.weight", matrix(n_embd, n_embd)
        if key_bias or attention != "attn_k":
            yield f"{block}.{attention}.bias", np.zeros(n_embd, dtype=np.float32)
    yield f"{block}.ffn_up.weight", matrix(n_ff, n_embd)
    yield f"{block}.ffn_up.bias", np.zeros(n_ff, dtype=np.float32)
    yield f"{block}.ffn_down.weight", matrix(n_embd, n_ff)
    yield f"{block}.ffn_down.bias", np.zeros(n_embd, dtype=np.float32)
