"""The plots of docs/benchmarks.md, drawn from result files kept in the repository. A result file holds figures a
bench run printed, each run with the command that measured it, the date its figures were recorded and the commit
that recorded them. Each plot's image is committed beside the pages (docs/plots/NAME.svg), so that the page shows
it on GitHub as on the site; the command that rewrites the generated parts draws it again, and an image that
differs from what its result file draws now fails the strict build (mkdocs hook: ``hooks:`` in mkdocs.yml).

    docs/results/NAME.json ──load()──▶ Plot ──svg()──────▶ docs/plots/NAME.svg (write_images; stale_images checks)
                                           └──caption()──▶ the image and its runs' commands and dates, kept in
                                                            the page as hooks.py's `<!-- generated: plot NAME -->`

    python docs/plots.py NAME    writes NAME.svg into the current folder, to look at one plot
"""
from __future__ import annotations

import io
import logging
import re
import sys
from pathlib import Path
from typing import Any, Literal

import msgspec

RESULTS = Path(__file__).resolve().parent / "results"
IMAGES = Path(__file__).resolve().parent / "plots"
COMMAND = "uv run --locked --extra docs python docs/hooks.py --write"
log = logging.getLogger("mkdocs.hooks.plots")  # under "mkdocs": a warning fails the --strict build
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
COMMIT = re.compile(r"^[0-9a-f]{7,40}$")


class Run(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One bench run's figures for one series of one panel; ``low``/``high`` the range over its repeats where
    the run printed one (``null`` where it did not)."""

    panel: str
    label: str
    command: str
    date: str
    recorded_in: str
    x: list[int | str]
    y: list[float]
    low: list[float | None] | None = None
    high: list[float | None] | None = None


class Plot(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    title: str
    kind: Literal["lines", "bars"]
    xlabel: str
    ylabel: str
    panels: list[str]
    runs: list[Run]
    reference: float | None = None  # a horizontal line: 1.0 is a tie with the baseline
    reference_label: str = "a tie"


def names() -> list[str]:
    return sorted(p.stem for p in RESULTS.glob("*.json"))


def load(name: str) -> Plot:
    """The result file ``docs/results/NAME.json``, checked; a file that breaks a rule raises naming it."""
    path = RESULTS / f"{name}.json"
    try:
        plot = msgspec.json.decode(path.read_bytes(), type=Plot)
    except (OSError, msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ValueError(f"docs/results/{name}.json: {e}") from e
    for i, run in enumerate(plot.runs):
        problem = _problem(plot, run)
        if problem:
            raise ValueError(f"docs/results/{name}.json: runs[{i}] ({run.label!r}): {problem}")
    return plot


def _problem(plot: Plot, run: Run) -> str | None:
    if run.panel not in plot.panels:
        return f"panel {run.panel!r} is not one of the file's panels {plot.panels}"
    if not DATE.match(run.date) or not COMMIT.match(run.recorded_in) or not run.command.startswith("python -m bench"):
        return "each run needs a date (YYYY-MM-DD), the commit that recorded it and its `python -m bench` command"
    if not run.y or any(len(v) != len(run.y) for v in (run.x, run.low or run.y, run.high or run.y)):
        return "x, y, low and high must have one value per point"
    if plot.kind == "lines" and not all(isinstance(x, int) for x in run.x):
        return "a line plot's x values are numbers"
    return None


def caption(name: str) -> str:
    """The image of ``plots/NAME.svg`` and, under it, each run's command and when it was recorded."""
    plot = load(name)
    runs = dict.fromkeys((r.command, r.date, r.recorded_in) for r in plot.runs)
    lines = [f"![{plot.title}](plots/{name}.svg)", "",
             f"Drawn from `docs/results/{name}.json` into `docs/plots/{name}.svg`, figures of:", ""]
    lines += [f"- `{command}` (recorded {date}, {commit})" for command, date, commit in runs]
    return "\n".join(lines)


def svg(plot: Plot) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.hashsalt": "mpserve", "svg.fonttype": "none", "font.size": 9})
    fig, axes = plt.subplots(1, len(plot.panels), figsize=(max(9.5, 5.6 * len(plot.panels)), 4.6), squeeze=False)
    colours = {label: f"C{i}" for i, label in enumerate(dict.fromkeys(r.label for r in plot.runs))}
    for ax, panel in zip(axes[0], plot.panels, strict=True):
        runs = [r for r in plot.runs if r.panel == panel]
        (_lines if plot.kind == "lines" else _bars)(ax, runs, colours)
        if plot.reference is not None:
            ax.axhline(plot.reference, color="grey", linestyle="--", linewidth=1, label=plot.reference_label)
        ax.set_title(panel)
        ax.set_xlabel(plot.xlabel)
        ax.set_ylabel(plot.ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
    handles: dict[str, Any] = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(len(handles), 3), frameon=False)
    fig.suptitle(plot.title)
    fig.tight_layout(rect=(0, 0.06 + 0.04 * ((len(handles) - 1) // 3), 1, 1))
    out = io.StringIO()
    fig.savefig(out, format="svg", metadata={"Date": None})
    plt.close(fig)
    return out.getvalue()


def _errors(run: Run) -> tuple[list[float], list[float]] | None:
    """Error bar lengths below and above each point, 0 where the run gave no range."""
    if run.low is None or run.high is None:
        return None
    below = [y - lo if lo is not None else 0.0 for y, lo in zip(run.y, run.low, strict=True)]
    above = [hi - y if hi is not None else 0.0 for y, hi in zip(run.y, run.high, strict=True)]
    return below, above


def _lines(ax: Any, runs: list[Run], colours: dict[str, str]) -> None:
    """A line per run, the x axis in powers of two; runs of one label share its colour."""
    for run in runs:
        ax.errorbar(run.x, run.y, yerr=_errors(run), color=colours[run.label], marker="o", capsize=3,
                    label=run.label)
    ax.set_xscale("log", base=2)
    ticks = sorted({int(x) for run in runs for x in run.x})
    ax.set_xticks(ticks, [str(t) for t in ticks])


def _bars(ax: Any, runs: list[Run], colours: dict[str, str]) -> None:
    """A group of bars per x category, a bar per label within it."""
    categories = list(dict.fromkeys(str(x) for run in runs for x in run.x))
    labels = list(dict.fromkeys(run.label for run in runs))
    width = 0.8 / len(labels)
    for run in runs:
        offset = (labels.index(run.label) - (len(labels) - 1) / 2) * width
        xs = [categories.index(str(x)) + offset for x in run.x]
        ax.bar(xs, run.y, width, yerr=_errors(run), capsize=3, color=colours[run.label], label=run.label)
    ax.set_xticks(range(len(categories)), categories, rotation=25, ha="right")


def stale_images() -> list[str]:
    """The plots whose image in docs/plots/ is missing or differs from what its result file draws now, then the
    images there that no result file draws."""
    drawn = [name for name in names() if not _image(name).is_file() or _image(name).read_text() != svg(load(name))]
    return drawn + sorted(p.stem for p in IMAGES.glob("*.svg") if p.stem not in names())


def write_images() -> None:
    """Each plot's image drawn again where it is stale, and the images of no result file removed."""
    IMAGES.mkdir(exist_ok=True)
    for name in stale_images():
        if name in names():
            _image(name).write_text(svg(load(name)))
        else:
            _image(name).unlink()


def _image(name: str) -> Path:
    return IMAGES / f"{name}.svg"


def on_pre_build(config: Any, **_: Any) -> None:
    """mkdocs' hook: a stale image is a warning (so ``--strict`` fails) naming the command that draws it."""
    for name in stale_images():
        log.warning("docs/plots/%s.svg is stale: run `%s`", name, COMMAND)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        Path(f"{arg}.svg").write_text(svg(load(arg)))
