"""What a benchmark section reports: figures measured side by side with a baseline, and targets.

A ``Figure`` holds one value per repeat for mpserve and one per repeat for its baseline, measured in the
same run. It reports the median of each, their spread (half the min-max range, as a percentage of the
median) and the median of the per-repeat ratios value ÷ baseline, so a slow repeat moves both sides.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any


def percentile(values: list[float], percent: float) -> float:
    """Nearest-rank percentile; fine for the few hundred to few thousand samples a bench collects."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(percent / 100 * len(ordered)))
    return ordered[rank - 1]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def spread_percent(values: list[float]) -> float:
    """Half the min-max range as a percentage of the median; 0 for a single repeat."""
    mid = median(values)
    if len(values) < 2 or not mid:
        return 0.0
    return (max(values) - min(values)) / 2 / abs(mid) * 100


@dataclass
class Figure:
    metric: str  # e.g. "tokens/s", "TTFT p50"
    unit: str  # e.g. "tok/s", "ms"
    values: list[float] = field(default_factory=list)  # mpserve, one per repeat
    baseline: list[float] = field(default_factory=list)  # the baseline, one per repeat

    def add(self, value: float, baseline: float) -> None:
        self.values.append(value)
        self.baseline.append(baseline)

    @property
    def value(self) -> float:
        return median(self.values)

    @property
    def base(self) -> float:
        return median(self.baseline)

    @property
    def ratio(self) -> float:
        return median([v / b for v, b in zip(self.values, self.baseline, strict=True) if b])

    def to_json(self) -> dict[str, Any]:
        return {"metric": self.metric, "unit": self.unit, "median": self.value, "spread_pct": spread_percent(
            self.values), "baseline_median": self.base, "baseline_spread_pct": spread_percent(self.baseline),
                "ratio": self.ratio, "values": self.values, "baseline_values": self.baseline}


@dataclass
class Case:
    """One row of a section's table: labels (e.g. instances, concurrency) and its figures."""

    labels: dict[str, str]
    figures: list[Figure]
    plotted: bool = True  # a row that is not a point of a concurrency curve says False

    def figure(self, metric: str) -> Figure:
        return next(f for f in self.figures if f.metric == metric)

    def to_json(self) -> dict[str, Any]:
        return {"labels": self.labels, "figures": [f.to_json() for f in self.figures], "plotted": self.plotted}


@dataclass(frozen=True)
class Target:
    """A goal on one figure's median ratio (or median value): ``measured op threshold``."""

    text: str
    measured: float
    op: str  # "<=", ">=", "<"
    threshold: float
    unit: str = "×"  # "×" for a ratio to the baseline, else the unit of a median value

    @property
    def met(self) -> bool:
        return {"<=": self.measured <= self.threshold, ">=": self.measured >= self.threshold,
                "<": self.measured < self.threshold}[self.op]

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "measured": self.measured, "op": self.op, "threshold": self.threshold,
                "unit": self.unit, "met": self.met}


@dataclass
class Section:
    key: str  # the --only name
    title: str
    baseline: str  # what the baseline column is
    cases: list[Case] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None  # why nothing was measured (something it needs is missing here)
    error: str | None = None  # the section failed: the exception, in one line
    seconds: float = 0.0  # how long the section took

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "title": self.title, "baseline": self.baseline, "skipped": self.skipped,
                "error": self.error, "seconds": self.seconds, "notes": self.notes,
                "cases": [c.to_json() for c in self.cases], "targets": [t.to_json() for t in self.targets]}
