"""Writing a run down: a Markdown report, a JSON file, and PNG plots where matplotlib is importable."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .figures import Case, Figure, Section, Target, spread_percent

CELL_KEY = "Cells read `median ±spread% / baseline = ratio×`: medians over the repeats, spread = half the " \
           "min–max range over the repeats, ratio = median of the per-repeat ratios mpserve ÷ baseline."


def number(x: float) -> str:
    if math.isnan(x):
        return "–"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def cell(f: Figure) -> str:
    return f"{number(f.value)} ±{spread_percent(f.values):.0f}% / {number(f.base)} = {f.ratio:.2f}×"


def markdown(header: list[str], sections: list[Section]) -> str:
    lines = [*header, "", CELL_KEY, "", "## Targets", ""]
    targets = [t for s in sections for t in s.targets]
    lines += _table(["target", "measured", "met"], [[t.text, _measured(t), "yes" if t.met else "**no**"]
                                                    for t in targets]) if targets else ["(none measured)"]
    for number_, s in enumerate(sections, 1):
        lines += ["", f"## {number_}. {s.title}", "", f"Baseline: {s.baseline}. ({s.seconds:.0f} s)", ""]
        if s.error:
            lines.append(f"**Failed**: {s.error}")
        elif s.skipped:
            lines.append(f"Skipped: {s.skipped}")
        elif s.cases:
            label_keys = list(dict.fromkeys(k for c in s.cases for k in c.labels))
            metrics = list(dict.fromkeys((f.metric, f.unit) for c in s.cases for f in c.figures))
            rows = []
            for c in s.cases:
                by_metric = {f.metric: f for f in c.figures}
                rows.append([c.labels.get(k, "") for k in label_keys]
                            + [cell(by_metric[m]) if m in by_metric else "–" for m, _ in metrics])
            lines += _table(label_keys + [f"{m} ({u})" for m, u in metrics], rows)
        lines += [""] + [f"- {note}" for note in s.notes] if s.notes else []
    return "\n".join(lines) + "\n"


def _measured(t: Target) -> str:
    return f"{number(t.measured)} {t.unit}" if t.unit != "×" else f"{t.measured:.2f}×"


def _table(head: list[str], rows: Iterable[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def write_json(path: Path, meta: dict[str, Any], sections: list[Section]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**meta, "sections": [s.to_json() for s in sections]}, indent=2, allow_nan=True))


def write_plots(stem: Path, sections: list[Section]) -> list[Path]:
    """Throughput and latency against concurrency, one panel per section that has them."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    panels = [s for s in sections if s.key in ("scaling", "peers") and s.cases and not s.skipped]
    if not panels:
        return []
    written = []
    for name, metrics in (("throughput", ("tokens/s",)), ("latency", ("latency p50", "TTFT p50"))):
        fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
        for ax, section in zip(axes[0], panels, strict=True):
            _panel(ax, section, metrics)
        fig.tight_layout()
        path = stem.with_name(f"{stem.name}-{name}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _panel(ax: Any, section: Section, metrics: tuple[str, ...]) -> None:
    """mpserve solid (TTFT dashed), baselines dotted. Scaling: a colour per configuration, its direct
    baseline in the same colour. Peers: mpserve configurations in greys, each peer in its own colour."""
    cases = [c for c in section.cases if c.plotted]
    if section.key == "scaling":
        for i, (config, rows) in enumerate(_curves(cases, "instances×threads").items()):
            _curve(ax, rows, metrics, f"C{i}", f"mpserve {config}")
            ax.plot(_xs(rows), [c.figure(metrics[0]).base for c in rows], ":", color=f"C{i}",
                    label=f"direct {config} {metrics[0]}")
    else:
        for i, (config, rows) in enumerate(_curves(cases, "mpserve").items()):
            _curve(ax, rows, metrics, str(0.6 * i), f"mpserve {config}")
        for i, (peer, rows) in enumerate(_curves(cases, "vs").items()):
            ax.plot(_xs(rows), [c.figure(metrics[0]).base for c in rows], ":o", color=f"C{i}",
                    label=f"{peer} {metrics[0]}")
    _axes(ax, section, metrics)


def _curves(cases: list[Case], label: str) -> dict[str, list[Case]]:
    """One curve per value of ``label``: its cases, one per concurrency (the first seen of each)."""
    curves: dict[str, dict[str, Case]] = {}
    for c in cases:
        curves.setdefault(c.labels[label], {}).setdefault(c.labels["concurrency"], c)
    return {name: list(by_concurrency.values()) for name, by_concurrency in curves.items()}


def _curve(ax: Any, rows: list[Case], metrics: tuple[str, ...], colour: str, name: str) -> None:
    for style, metric in zip(("-o", "--s"), metrics, strict=False):
        ax.plot(_xs(rows), [c.figure(metric).value for c in rows], style, color=colour, label=f"{name} {metric}")


def _xs(rows: list[Case]) -> list[int]:
    return [int(c.labels["concurrency"]) for c in rows]


def _axes(ax: Any, section: Section, metrics: tuple[str, ...]) -> None:
    ax.set_xscale("log", base=2)
    if len(metrics) > 1:  # latencies span orders of magnitude once requests queue
        ax.set_yscale("log")
    ax.set_xticks(sorted({int(c.labels["concurrency"]) for c in section.cases}))
    ax.get_xaxis().set_major_formatter("{x:.0f}")
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel(f"{metrics[0]} ({section.cases[0].figure(metrics[0]).unit})")
    ax.set_title(section.title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
