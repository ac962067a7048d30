"""``python -m bench``: run the chosen sections, print a Markdown report, write JSON (and PNG plots).

Sections run one after another, each starting and stopping its own servers, so any subset can run
alone. A section that cannot run here (a peer server that is not installed) is reported as skipped; one
that fails is reported as failed and makes the exit status 1.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import datetime
from importlib.metadata import version
from pathlib import Path

from . import adapters_bench, batching, broker, dispatch, memory, peers, permits, scaling, speculation_bench, startup
from .figures import Section
from .procs import find_llama_server
from .report import markdown, write_json, write_plots
from .settings import Settings

SECTIONS: dict[str, Callable[[Settings], Section]] = {
    "dispatch": dispatch.run, "broker": broker.run, "scaling": scaling.run, "peers": peers.run,
    "batching": batching.run, "memory": memory.run, "permits": permits.run, "startup": startup.run,
    "speculation": speculation_bench.run, "adapters": adapters_bench.run,
}
RESULTS = Path(__file__).parent / "results"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run [default: all: {','.join(SECTIONS)}]")
    parser.add_argument("--repeat", type=int, help="repeats of every measurement [default: 3; 1 with --quick]")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, few requests: checks that the harness works (under a minute)")
    parser.add_argument("--model", type=Path, help="GGUF file [default: the built-in bench model, or tiny with "
                                                   "--quick]")
    parser.add_argument("--llama-server", help="llama-server binary for the peers and batching sections [default: "
                                               "on PATH, else /opt/llama-server*/; '' leaves it out]")
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"where JSON and plots go [default: {RESULTS}]")
    args = parser.parse_args(argv)
    unknown = set(args.only.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    if args.repeat is not None and args.repeat < 1:
        parser.error("--repeat must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from mpserve.models.builtin import builtin_model_path

    settings = Settings.make(
        quick=args.quick, repeat=args.repeat or (1 if args.quick else 3),
        model=args.model or builtin_model_path("tiny" if args.quick else "bench"),
        llama_server=find_llama_server(args.llama_server))
    chosen = [key for key in SECTIONS if key in args.only.split(",")]
    started = datetime.now()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="mpb-", dir="/tmp") as runtime:
        os.chmod(runtime, 0o700)
        os.environ["MPSERVE_RUNTIME_DIR"] = runtime  # short ipc paths, apart from any running server
        sections = [_run(key, settings) for key in chosen]
    load = (load_before, os.getloadavg()[0])
    meta = {**_meta(settings, started), "load_average_1min": load}
    stem = args.results / started.strftime("bench-%Y%m%d-%H%M%S")
    write_json(stem.with_suffix(".json"), meta, sections)
    plots = write_plots(stem, sections)
    sys.stdout.write(markdown(_header(settings, started, load, meta["git"], plots), sections))
    _log(f"wrote {stem.with_suffix('.json')}" + "".join(f", {p}" for p in plots))
    return 1 if any(s.error for s in sections) else 0


def _run(key: str, settings: Settings) -> Section:
    _log(f"{key}: running")
    started = time.monotonic()
    try:
        section = SECTIONS[key](settings)
    except Exception as exc:  # one broken section must not hide the others' figures
        traceback.print_exc()
        section = Section(key, key, "-", error=f"{type(exc).__name__}: {exc}".splitlines()[0])
    section.seconds = time.monotonic() - started
    _log(f"{key}: {section.error or section.skipped or 'done'} in {section.seconds:.0f} s")
    return section


def _meta(settings: Settings, started: datetime) -> dict[str, object]:
    return {
        "started": started.isoformat(timespec="seconds"), "quick": settings.quick, "repeat": settings.repeat,
        "model": str(settings.model), "model_bytes": settings.model.stat().st_size,
        "llama_server": settings.llama_server, "cores": settings.cores, "workload": vars(settings.work),
        "python": platform.python_version(), "llama_cpp_python": version("llama_cpp_python"),
        "pyzmq": version("pyzmq"), "machine": platform.machine(), "git": _git_describe(),
    }


def _git_describe() -> str | None:
    """The commit the serving code came from, "-dirty" when the work tree differs from it."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _header(settings: Settings, started: datetime, load: tuple[float, float], git: object,
            plots: list[Path]) -> list[str]:
    lines = [
        f"# mpserve bench{' (quick)' if settings.quick else ''}, {started:%Y-%m-%d %H:%M}", "",
        f"Model `{settings.model.name}` ({settings.model.stat().st_size / 2**20:.0f} MiB), {settings.cores} cores, "
        f"{settings.repeat} repeat{'s' if settings.repeat != 1 else ''}, Python {platform.python_version()}, "
        f"llama-cpp-python {version('llama_cpp_python')}, mpserve {git or 'outside git'}. Load average (1 min) "
        f"{load[0]:.1f} before, {load[1]:.1f} after.", "",
        f"> This machine has {settings.cores} cores. The load generator, the broker and the workers (and the peer "
        "servers) all run on it at once and compete for CPU, so every figure here includes that contention, "
        "on both sides of each ratio. Anything else running at the same time (see the load average) adds to it.",
    ]
    if plots:
        lines += ["", "Plots: " + ", ".join(f"`{p}`" for p in plots)]
    return lines


def _log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
