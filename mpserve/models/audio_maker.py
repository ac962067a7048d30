"""Deterministic random audio projectors for the built-in models, written as GGUF files llama.cpp's ``clip`` loader
reads (``mpserve make-model audio.gguf --size tiny --mmproj mmproj.gguf --audio``).

No audio model can be downloaded where mpserve is tested, so it writes its own: a projector of llama.cpp's ``qwen2a``
type (Qwen2-Audio's: a Whisper-style encoder and one linear map, the fewest tensors of the audio types its loader
supports) whose output width is the text model's ``n_embd``:

    WAV / MP3 ──mtmd: decoded to mono 16 kHz samples, padded with 30 s of silence──▶ log-mel spectrogram of
    MEL_BINS bins in chunks of 3000 frames (30 s each; the padding's own chunk dropped) ──▶ a.conv1d.1 (kernel 3)
    ─▶ GELU ─▶ a.conv1d.2 (kernel 3, stride 2) ─▶ GELU ──▶ + a.position_embd (1500 rows) ──▶ AUDIO_LAYERS
    Whisper blocks (a.blk.N: ln1, attn_q/k/v/out (no k bias), ln2, ffn_up/down) ─▶ average pool of 2 ─▶ a.post_ln
    ──▶ mm.a.fc (a linear map to n_embd) ──▶ TOKENS_PER_CHUNK positions of the text model's prompt per 30 s

llama.cpp puts ``<|audio_bos|>`` before a clip's positions and ``<|audio_eos|>`` after them, as text. Row 0 of
``mm.a.fc`` is zero and its bias 1: an audio embedding holds the built-in models' residual constant in dimension 0,
as their token embeddings do (``mpserve.models.maker``), and ``mm.a.fc`` is scaled so the embeddings are about as
large as the token embeddings.

Same arguments, same bytes: weights come from ``numpy.random.RandomState(AUDIO_SEED)`` drawn in file order.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np

from .maker import finish, write_atomically
from .mmproj_maker import encoder_block, output_map
from .shapes import ModelShape, shape_for

MEL_BINS = 16
CHUNK_FRAMES = 3000  # mel frames per chunk: 30 s at llama.cpp's hop of 160 samples at 16 kHz
TOKENS_PER_CHUNK = CHUNK_FRAMES // 2 // 2  # the stride-2 convolution, then the average pool
AUDIO_EMBD = 32
AUDIO_FF = 48
AUDIO_HEADS = 2
AUDIO_LAYERS = 1
AUDIO_SEED = 11
_LN_EPS = 1e-5
_EMBEDDING_GAIN = 3.0  # mm.a.fc's scale: the embeddings come out about as large as the token embeddings


def write_audio_projector(path: str | os.PathLike[str], size: str = "tiny") -> Path:
    """Write the audio projector of the built-in ``size`` model to ``path`` atomically and return the path."""
    shape = shape_for(size)
    return write_atomically(Path(path), lambda tmp: _write(tmp, f"mpserve-{size}-audio-mmproj", shape))


def _write(path: Path, name: str, shape: ModelShape) -> None:
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_name(name)
    writer.add_bool("clip.has_audio_encoder", True)
    writer.add_string("clip.projector_type", "qwen2a")
    sizes = {"num_mel_bins": MEL_BINS, "embedding_length": AUDIO_EMBD, "feed_forward_length": AUDIO_FF,
             "block_count": AUDIO_LAYERS, "projection_dim": shape.n_embd, "attention.head_count": AUDIO_HEADS}
    for key, value in sizes.items():
        writer.add_uint32(f"clip.audio.{key}", value)
    writer.add_float32("clip.audio.attention.layer_norm_epsilon", _LN_EPS)
    for tensor_name, tensor in _weights(shape.n_embd):
        writer.add_tensor(tensor_name, tensor)
    finish(writer)


def _weights(n_embd: int) -> Iterator[tuple[str, np.ndarray]]:
    """All tensors in file order (numpy's shapes: ggml's ``ne`` reversed), drawn from one RandomState in that order."""
    rng = np.random.RandomState(AUDIO_SEED)

    def matrix(n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        weight: np.ndarray = (rng.standard_normal((n_out, n_in)) * (gain / np.sqrt(n_in))).astype(np.float32)
        return weight

    def zeros(*shape: int) -> np.ndarray:
        return np.zeros(shape, dtype=np.float32)

    for conv, n_in in ((1, MEL_BINS), (2, AUDIO_EMBD)):  # kernels f16, as converted models have them
        kernel = rng.standard_normal((AUDIO_EMBD, n_in, 3)) / np.sqrt(3 * n_in)
        yield f"a.conv1d.{conv}.weight", kernel.astype(np.float16)
        yield f"a.conv1d.{conv}.bias", zeros(AUDIO_EMBD, 1)  # one per channel, broadcast along the frames
    yield "a.position_embd.weight", matrix(CHUNK_FRAMES // 2, AUDIO_EMBD)
    for layer in range(AUDIO_LAYERS):  # Whisper's key projection has no bias
        yield from encoder_block(f"a.blk.{layer}", AUDIO_EMBD, AUDIO_FF, matrix, key_bias=False)
    yield "a.post_ln.weight", np.ones(AUDIO_EMBD, dtype=np.float32)
    yield "a.post_ln.bias", zeros(AUDIO_EMBD)
    yield from zip(("mm.a.fc.weight", "mm.a.fc.bias"), output_map(matrix(n_embd, AUDIO_EMBD, _EMBEDDING_GAIN)),
                   strict=True)
