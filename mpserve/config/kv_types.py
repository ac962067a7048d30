"""llama.cpp's KV cache types: the name a setting gives (``cache_type_k`` / ``cache_type_v``, as
llama-server's ``--cache-type-k``), ggml's type id for the context parameters, and the bytes one element
takes, for the placement estimate.

    settings (choices) ──▶ config (checked: a quantized V needs flash attention)
                       ──▶ gpu.placement (bytes per element × cells × layers)
                       ──▶ engine.context (llama_context_params.type_k / type_v)

A quantized type stores blocks of ``block`` elements in ``block_bytes`` bytes; a head's size must be a whole
number of blocks (``check_head_size``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVType:
    name: str
    ggml_type: int  # enum ggml_type (ggml.h); stable numbers
    block: int  # elements per block
    block_bytes: int

    @property
    def quantized(self) -> bool:
        return self.block > 1

    @property
    def bytes_per_element(self) -> float:
        return self.block_bytes / self.block


KV_TYPES: dict[str, KVType] = {t.name: t for t in (
    KVType("f32", 0, 1, 4),
    KVType("f16", 1, 1, 2),
    KVType("bf16", 30, 1, 2),
    KVType("q8_0", 8, 32, 34),
    KVType("q4_0", 2, 32, 18),
    KVType("q4_1", 3, 32, 20),
    KVType("iq4_nl", 20, 32, 18),
    KVType("q5_0", 6, 32, 22),
    KVType("q5_1", 7, 32, 24),
)}
DEFAULT_KV_TYPE = "f16"  # llama.cpp's default


def check_head_size(kind: str, name: str, head_size: int) -> str | None:
    """Why a head of ``head_size`` elements cannot be stored as ``name`` (None: it can); ``kind`` is K or V."""
    kv_type = KV_TYPES[name]
    if head_size % kv_type.block:
        return (f"cache_type_{kind.lower()} {name} stores blocks of {kv_type.block} elements, and this model's {kind} "
                f"heads have {head_size}; use f16, bf16 or f32")
    return None
