"""The built-in models' shapes: the hyperparameters of each size (``builtin:tiny``, ``builtin:bench``, ...).

    MODEL_SIZES ──shape_for(size)──▶ ModelShape ──▶ builtin (where its file lives), maker (writes it)

A leaf: it imports neither gguf nor numpy, so naming or sizing a built-in model costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mpserve.errors import BadRequest


@dataclass(frozen=True)
class ModelShape:
    """The hyperparameters of one generated model; ``dtype`` is the type of its 2-D weight matrices."""

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int
    seed: int
    dtype: Literal["f32", "f16"]
    pooling: Literal["mean", "rank"] | None = None  # an embedding model's pooling type, written to the GGUF;
    # rank: a reranker (Qwen 3's architecture, whose rank head llama.cpp reads: cls.output, two labels)
    kept_layers: int | None = None  # a draft: the weights drawn for n_layer blocks, the first kept_layers written

    @property
    def written_layers(self) -> int:
        return self.n_layer if self.kept_layers is None else self.kept_layers

    def parameter_count(self, n_vocab: int) -> int:
        """Number of weights, norms included, for a vocabulary of ``n_vocab`` tokens."""
        n_embd_kv = self.n_embd // self.n_head * self.n_head_kv
        attention = 2 * self.n_embd * self.n_embd + 2 * self.n_embd * n_embd_kv
        per_layer = attention + 3 * self.n_embd * self.n_ff + 2 * self.n_embd
        return self.written_layers * per_layer + 2 * n_vocab * self.n_embd + self.n_embd


MODEL_SIZES: dict[str, ModelShape] = {
    "tiny": ModelShape(
        n_embd=64, n_layer=2, n_head=4, n_head_kv=4, n_ff=128, n_ctx_train=2048, seed=1, dtype="f32"
    ),
    "bench": ModelShape(
        n_embd=768, n_layer=12, n_head=12, n_head_kv=12, n_ff=2048, n_ctx_train=2048, seed=2, dtype="f16"
    ),
    # the tiny model as an embedding model: mean pooling declared in the GGUF (serve it with embedding: true)
    "tiny-embed": ModelShape(
        n_embd=64, n_layer=2, n_head=4, n_head_kv=4, n_ff=128, n_ctx_train=2048, seed=1, dtype="f32", pooling="mean"
    ),
    # a reranker of the tiny model's size: llama.cpp's rank pooling scores a query and document pair
    "tiny-rerank": ModelShape(
        n_embd=64, n_layer=2, n_head=4, n_head_kv=4, n_ff=128, n_ctx_train=2048, seed=3, dtype="f32", pooling="rank"
    ),
    # the tiny model's first block only: a draft model for it (speculative: {type: draft})
    "tiny-draft": ModelShape(
        n_embd=64, n_layer=2, n_head=4, n_head_kv=4, n_ff=128, n_ctx_train=2048, seed=1, dtype="f32", kept_layers=1
    ),
}


def shape_for(size: str) -> ModelShape:
    try:
        return MODEL_SIZES[size]
    except KeyError:
        allowed = ", ".join(sorted(MODEL_SIZES))
        raise BadRequest(f"unknown model size {size!r}; allowed sizes: {allowed}") from None


