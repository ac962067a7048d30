"""A model's thinking setting (``models[].reasoning``), shared by the config, the worker spec and the engine
(``mpserve.engine.thinking`` holds the budget; ``mpserve.gateway.api.reasoning`` reads the request).

    YAML {low: N, medium: N, high: N, close: TEXT} ──config.build──▶ Reasoning ──EngineSpec──▶ BatchEngine
        (its EngineSettings)

``parse`` checks the mapping; a bad key or value raises ValueError with what is allowed, which the config turns
into a ConfigError naming the file and the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

MAX_BUDGET = 1 << 20  # tokens: the protocol's most (``GenerateParams.reasoning_budget``)
MAX_CLOSE_CHARS = 256


@dataclass(frozen=True)
class Reasoning:
    """The thinking budget in tokens of each ``reasoning_effort`` (``medium`` when a request names none), and
    ``close``: the text written before the end tag when a budget forces it ("" for none), such as "Time to
    answer."."""

    low: int = 1024
    medium: int = 4096
    high: int = 16384
    close: str = ""

    def budget(self, effort: str | None) -> int:
        """The budget of ``effort`` (low, medium, high; None: medium)."""
        return {"low": self.low, "medium": self.medium, "high": self.high}[effort or "medium"]


def parse(value: Any) -> Reasoning:
    """``{low, medium, high, close}``, each optional."""
    if not isinstance(value, Mapping):
        raise ValueError(f"got {str(value)[:40]!r}, expected a mapping like {{low: 1024, medium: 4096, high: "
                         "16384, close: \"Time to answer.\"}")
    allowed = [f.name for f in fields(Reasoning)]
    unknown = [k for k in value if k not in allowed]
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}; allowed keys: {', '.join(allowed)}")
    for key in ("low", "medium", "high"):
        v = value.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_BUDGET):
            raise ValueError(f"{key}: got {v!r}, allowed: a number of tokens, 0 to {MAX_BUDGET}")
    close = value.get("close", "")
    if not isinstance(close, str) or len(close) > MAX_CLOSE_CHARS:
        raise ValueError(f"close: got {str(close)[:40]!r}, allowed: a text of at most {MAX_CLOSE_CHARS} characters")
    return Reasoning(**value)
