"""What a ``BatchEngine`` is built with: one frozen object, checked before anything loads.

    worker spec (mpserve.worker.spec) ──EngineSettings(...)──▶ check() ──▶ BatchEngine(settings, model)
                                                                          ├─ context   path, n_ctx, parallel, threads,
                                                                          │            GPU layers, KV types, flash
                                                                          │            attention, repack, template
                                                                          ├─ scheduler step_budget_tokens
                                                                          ├─ cells     reuse, kv_unified
                                                                          ├─ keeping   the host store's tiers
                                                                          ├─ adapters  LoRA adapters to load
                                                                          ├─ thinking  reasoning: budgets, close message
                                                                          └─ media     mmproj: the image projector
"""

from __future__ import annotations

from dataclasses import dataclass

from mpserve.config.kv_types import DEFAULT_KV_TYPE, KV_TYPES
from mpserve.config.reasoning import Reasoning
from mpserve.config.remote_tier import RemoteTier
from mpserve.config.speculative import Speculative

FLASH_ATTN_TYPES = {"auto": "LLAMA_FLASH_ATTN_TYPE_AUTO", "on": "LLAMA_FLASH_ATTN_TYPE_ENABLED",
                    "off": "LLAMA_FLASH_ATTN_TYPE_DISABLED"}
"""``flash_attn`` settings and llama.cpp's names for them; auto: llama.cpp turns it on where the device
supports it (always on a CPU), as llama-server does by default."""

LIVE_SAVE_S = 1.0
"""How often (seconds) a generating sequence's cells are saved to the host store with ``reuse: exact``, for the
instance that goes on with it if this one is lost (``mpserve.engine.live``): about the most it decodes again."""

GRAMMAR_STEP_S = 0.5
"""Seconds of processor time a grammar's part of one sampling step may take: a JSON grammar's check of the token
drawn takes microseconds, its pass over a large vocabulary milliseconds; a grammar past this holds up every
sequence of the batch."""

REUSE_MODES = ("any", "exact")
"""What a prompt may start from: ``any`` computed cells holding a prefix of it, of any length; ``exact`` whole
prompt chunks of them only, so that output equals a fresh computation."""


@dataclass(frozen=True)
class EngineSettings:
    """``cache_ram`` bytes in ``cache_shm`` and ``cache_disk_size`` bytes in ``cache_disk``: the host store's tiers
    (``mpserve.engine.host_store``; no store without a RAM tier), and ``cache_remote`` the remote tier under them
    (``mpserve.engine.remote_store``). ``reuse``: ``any`` starts a prompt from the longest
    prefix of it that computed cells hold, ``exact`` from whole prompt chunks only (``mpserve.engine.batch``).
    ``chat_template``: the template the engine reports instead of the GGUF's (``read_chat_template``).
    ``grammar_step_s``: what a constrained sequence's grammar may spend on one step before the sequence ends with
    GrammarTooComplex (``mpserve.engine.sampling``). ``reasoning``: the thinking budgets and close message
    (``mpserve.engine.thinking``)."""

    path: str
    n_ctx: int
    parallel: int
    threads: int
    n_gpu_layers: int
    seed: int = 0
    step_budget_tokens: int = 64
    kv_unified: bool = False
    flash_attn: str = "auto"
    repack: bool = True
    speculative: Speculative | None = None
    cache_type_k: str = DEFAULT_KV_TYPE
    cache_type_v: str = DEFAULT_KV_TYPE
    cache_ram: int = 0
    cache_shm: str | None = None
    cache_disk: str | None = None
    cache_disk_size: int = 0
    cache_remote: RemoteTier | None = None
    reuse: str = "any"
    chat_template: str | None = None
    adapters: tuple[tuple[str, str], ...] = ()  # LoRA adapters to load: (name, path) (``mpserve.engine.adapters``)
    grammar_step_s: float = GRAMMAR_STEP_S
    reasoning: Reasoning = Reasoning()
    mmproj: str | None = None  # the model's image projector GGUF (``mpserve.engine.media``); None: text only
    live_save_s: float = LIVE_SAVE_S  # how often a generating sequence's cells are saved (``mpserve.engine.live``)

    @property
    def exact(self) -> bool:
        return self.reuse == "exact"

    def check(self, max_parallel: int) -> None:
        """ValueError naming the first setting out of its range (``max_parallel``: llama.cpp's most sequences)."""
        if not 1 <= self.parallel <= max_parallel:
            raise ValueError(f"parallel must be 1..{max_parallel}, got {self.parallel}")
        if self.flash_attn not in FLASH_ATTN_TYPES:
            raise ValueError(f"flash_attn must be one of {', '.join(FLASH_ATTN_TYPES)}, got {self.flash_attn!r}")
        if self.cache_type_k not in KV_TYPES or self.cache_type_v not in KV_TYPES:
            raise ValueError(f"cache types must be among {', '.join(KV_TYPES)}, got {self.cache_type_k!r}, "
                             f"{self.cache_type_v!r}")
        if self.reuse not in REUSE_MODES:
            raise ValueError(f"reuse must be one of {', '.join(REUSE_MODES)}, got {self.reuse!r}")
        if self.step_budget_tokens < 1 or self.n_ctx < 2:
            raise ValueError("step_budget_tokens must be >= 1 and n_ctx >= 2")
