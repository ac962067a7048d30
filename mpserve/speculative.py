"""A model's speculative decoding setting (``models[].speculative``), shared by the config, the worker spec
and the engine (``mpserve.engine.speculation`` does the work).

    YAML {type: ngram, n_max: 8, ...} ──config.build──▶ Speculative ──EngineSpec──▶ BatchEngine

``parse`` checks the mapping; a bad key or value raises ValueError with what is allowed, which the config
turns into a ConfigError naming the file and the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

TYPES = ("ngram",)


@dataclass(frozen=True)
class Speculative:
    """Prompt lookup: draft the tokens that followed the latest earlier occurrence of the sequence's last
    ``ngram_max`` .. ``ngram_min`` tokens (longest first), in its own prompt and output; at most ``n_max``
    drafts a step, none when fewer than ``n_min`` would be worth verifying."""

    type: str = "ngram"
    n_max: int = 8
    n_min: int = 1
    ngram_min: int = 2
    ngram_max: int = 4


_RANGES = {"n_max": (1, 64), "n_min": (1, 64), "ngram_min": (1, 16), "ngram_max": (1, 16)}


def parse(value: Mapping[str, Any] | str) -> Speculative:
    """``{type: ngram, n_max: ..., ...}``, or just ``ngram`` for the defaults."""
    given: Mapping[str, Any] = {"type": value} if isinstance(value, str) else value
    allowed = [f.name for f in fields(Speculative)]
    unknown = [k for k in given if k not in allowed]
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}; allowed keys: {', '.join(allowed)}")
    if given.get("type", "ngram") not in TYPES:
        raise ValueError(f"type: got {given['type']!r}, allowed: {', '.join(TYPES)}")
    for key, (lo, hi) in _RANGES.items():
        v = given.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi):
            raise ValueError(f"{key}: got {v!r}, allowed: an integer {lo} to {hi}")
    spec = Speculative(**given)
    if spec.n_min > spec.n_max or spec.ngram_min > spec.ngram_max:
        raise ValueError(f"n_min must be at most n_max and ngram_min at most ngram_max, got {spec}")
    return spec
