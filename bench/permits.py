"""Permits: what acquiring and releasing a device permit costs, from bench/permits_bench.py.

``measure_permits(n)`` reports microseconds; its ``flock`` figure (a bare kernel lock) is the baseline
for every other one. Left out when that module or function is not there.
"""

from __future__ import annotations

import importlib

from .figures import Case, Figure, Section
from .settings import Settings


def run(settings: Settings) -> Section:
    section = Section("permits", "Permits: acquire + release of a device permit",
                      "an uncontended fcntl.flock lock/unlock")
    try:
        measure = importlib.import_module("bench.permits_bench").measure_permits
    except (ImportError, AttributeError) as exc:
        section.skipped = f"bench/permits_bench.py has no measure_permits ({exc})"
        return section
    figures: dict[str, Figure] = {}
    for _ in range(settings.repeat):
        measured: dict[str, float] = measure(settings.pick(2000, 20000))
        timings = {k: v for k, v in measured.items() if k.endswith("_us")}
        baseline = next((v for k, v in timings.items() if "flock" in k), None)
        if baseline is None:
            section.skipped = f"measure_permits reported no flock baseline: {sorted(measured)}"
            return section
        for key, value in timings.items():
            if "flock" not in key:
                figures.setdefault(key, Figure(key.removesuffix("_us").replace("_", " "), "µs")).add(value, baseline)
    section.cases = [Case({"measurement": f.metric}, [Figure("time", "µs", f.values, f.baseline)])
                     for f in figures.values()]
    return section
