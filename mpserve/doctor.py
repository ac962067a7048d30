"""``mpserve doctor``: what this host offers mpserve, and what to fix.

    llama.cpp build  ── llama_build.probe_build (a child) ──▶ version, system info, backends, can offload
    GPUs             ── devices.detect: NVML, then nvidia-smi ───▶ each GPU with its free memory, the source
    repacking        ── repack.probe: a child decodes repacked weights ──▶ works, or crashes (then served without)
    start modes      ── layout.start_modes(config) ──▶ per model: forked from a zygote or from the fork server, why
    directories      ── runtime.runtime_dir, permits.default_lock_dir ──▶ path, usable or not
                                         ▼
                      Report: the facts, each problem with its fix, notes

The build's probe and its problems are ``mpserve.llama_build``'s, which ``mpserve start`` warns with too.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from mpserve.config.loader import ServerConfig
from mpserve.errors import ConfigError
from mpserve.gpu.devices import Device, detect, format_memory
from mpserve.gpu.permits import default_lock_dir
from mpserve.llama_build import Build, Problem, build_problems, probe_build
from mpserve.private import check_private_dir
from mpserve.repack import Verdict
from mpserve.repack import probe as probe_repack
from mpserve.runtime import runtime_dir


@dataclass(frozen=True)
class Directory:
    role: str  # "runtime" (sockets, server info) or "locks" (host-wide GPU permits)
    path: str
    state: str  # "ok", or what the first start will do
    problem: Problem | None = None


@dataclass(frozen=True)
class Report:
    build: Build
    gpus: list[Device]
    gpu_source: str  # "NVML", "nvidia-smi", "simulated" or "none"
    directories: list[Directory]
    repack: Verdict | None  # None: llama_cpp does not load, so nothing was probed
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    start_modes: dict[str, str] = field(default_factory=dict)  # model -> how its instances start, and why

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["build"]["backends"] = self.build.backends
        return out


def collect(build: Build | None = None, simulate: str | None = None,
            repack: Callable[[], Verdict] = probe_repack, config: ServerConfig | None = None) -> Report:
    """Everything ``mpserve doctor`` reports; ``build`` stands in for the build's probe (tests); ``config``: the
    models whose start modes to report (none: no models)."""
    build = build if build is not None else probe_build()
    gpus, source = detect(simulate if config is None else config.simulate_gpus or simulate)
    directories = [_runtime_directory(), _lock_directory()]
    problems = build_problems(build, gpus)
    problems += [d.problem for d in directories if d.problem is not None]
    verdict = repack() if build.version is not None else None
    return Report(build, gpus, source, directories, verdict, problems, _notes(build, gpus, source),
                  _start_modes(config) if config is not None else {})


def _start_modes(config: ServerConfig) -> dict[str, str]:
    from mpserve.server.layout import build_layout, start_modes

    with _verdict_unlogged():
        return {name: str(mode) for name, mode in start_modes(config, build_layout(config)).items()}


@contextmanager
def _verdict_unlogged() -> Iterator[None]:
    """The layout asks for the repack verdict as a server does, which logs it; the report has a line of its own
    for it, so it is not printed twice."""
    logger = logging.getLogger("mpserve.repack")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def format_report(report: Report) -> str:
    b = report.build
    lines = ["llama.cpp build"]
    if b.version is None:
        lines.append(f"  llama-cpp-python: does not load ({b.error})")
    else:
        lines += [f"  llama-cpp-python {b.version}; backends: {', '.join(b.backends) or 'unknown'}; "
                  f"GPU offload: {'yes' if b.gpu_offload else 'no'}",
                  f"  system info: {b.system_info.strip().rstrip('|').strip()}"]
    if report.gpus:
        lines.append(f"GPUs ({report.gpu_source})")
        lines += [f"  gpu{d.index}  {d.name}  {d.uuid}  {format_memory(d.memory_free)} free of "
                  f"{format_memory(d.memory_total)}" for d in report.gpus]
    else:
        lines.append("GPUs: none found (NVML, then nvidia-smi): instances run on the CPU")
    if report.repack is not None:
        lines.append(f"repacking: {'works' if report.repack.works else 'off (crashes here)'}"
                     f"{' (cached)' if report.repack.cached else ''}")
        lines.append(f"  {report.repack.summary}")
    lines.append("directories")
    lines += [f"  {d.role:8} {d.path}  {d.state}" for d in report.directories]
    if report.start_modes:
        lines.append("instances start from")
        lines += [f"  {name}: {mode}" for name, mode in report.start_modes.items()]
    if report.problems:
        lines.append("problems")
        for p in report.problems:
            lines += [f"  - {p.what}", f"    fix: {p.fix}"]
    else:
        lines.append("no problems found")
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)


def _notes(build: Build, gpus: Sequence[Device], source: str) -> list[str]:
    notes = []
    if source == "nvidia-smi" and importlib.util.find_spec("pynvml") is None:
        notes.append("GPUs were found through nvidia-smi; pip install 'mpserve[nvml]' adds per-process GPU memory "
                     "(mpserve devices, /backend/monitor, /metrics)")
    if not gpus and build.gpu_backends and not build.gpu_offload:
        notes.append(f"the build has {', '.join(build.gpu_backends)} but no GPU is visible here (none found, "
                     f"nvidia-smi {'on PATH' if shutil.which('nvidia-smi') else 'not on PATH'})")
    return notes


def _runtime_directory() -> Directory:
    path = runtime_dir(create=False)
    if not os.path.lexists(path):
        parent = next(p for p in path.parents if p.exists())
        if not os.access(parent, os.W_OK | os.X_OK):
            return Directory("runtime", str(path), "cannot be created", Problem(
                f"runtime directory {path} does not exist and {parent} is not writable",
                "set MPSERVE_RUNTIME_DIR to a folder of yours"))
        return Directory("runtime", str(path), "created, mode 0700, at the first start")
    try:
        check_private_dir(path, "runtime directory")  # its ipc sockets are the server's doors
    except ConfigError as exc:
        return Directory("runtime", str(path), "not private",
                         Problem(exc.message, "do as it says, or set MPSERVE_RUNTIME_DIR to a folder of yours"))
    return Directory("runtime", str(path), "ok (yours, mode 0700)")


def _lock_directory() -> Directory:
    try:
        path = default_lock_dir()  # created if absent, as every server and `mpserve devices` do
    except ConfigError as exc:
        return Directory("locks", "?", "unusable", Problem(exc.message, "set MPSERVE_LOCK_DIR to a folder of "
                                                                         "yours (mode 0700) that your servers share"))
    return Directory("locks", str(path), "ok (yours, mode 0700; every server of yours on this host must use it)")
