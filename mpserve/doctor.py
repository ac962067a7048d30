"""``mpserve doctor``: what this host offers mpserve, and what to fix.

    llama.cpp build  ── a child ``python -c`` imports llama_cpp ──▶ version, system info, backends, can offload
    GPUs             ── devices.detect: NVML, then nvidia-smi ───▶ each GPU with its free memory, the source
    repacking        ── repack.probe: a child decodes repacked weights ──▶ works, or crashes (then served without)
    start modes      ── layout.start_modes(config) ──▶ per model: forked from a zygote or from the fork server, why
    directories      ── runtime.runtime_dir, permits.default_lock_dir ──▶ path, usable or not
                                         ▼
                      Report: the facts, each problem with its fix, notes

The build is probed in a child process: importing llama_cpp loads llama.cpp and, in a CUDA build, the CUDA
runtime, which a server process never does (its workers do), and a broken build then fails the child, not
the caller. ``llama_supports_gpu_offload`` is true only when a GPU backend is compiled in *and* finds a
device, so the system info (the backends compiled in) tells a CPU-only build from a CUDA build that sees no
GPU.

``start_warnings`` is the same check for ``mpserve start`` and ``mpserve worker``: it probes the build only
when real (not simulated) GPUs were found and a model asks for GPU layers, so a CPU host pays nothing.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from mpserve.config.loader import ECHO_MODEL, ServerConfig
from mpserve.config.runtime import runtime_dir
from mpserve.errors import ConfigError
from mpserve.gpu.devices import Device, detect, format_memory
from mpserve.gpu.permits import default_lock_dir
from mpserve.repack import Verdict
from mpserve.repack import probe as probe_repack

PROBE_TIMEOUT_S = 60.0
PROBE = """
import json, llama_cpp
print(json.dumps({"version": llama_cpp.__version__,
                  "system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
                  "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload())}))
"""
CUDA_INSTALL = 'CMAKE_ARGS="-DGGML_CUDA=on" pip install llama-cpp-python --no-cache-dir --force-reinstall'
GPU_BACKENDS = frozenset({"CUDA", "ROCm", "MUSA", "Vulkan", "Metal", "SYCL", "CANN", "OpenCL"})


@dataclass(frozen=True)
class Build:
    """The installed llama-cpp-python, as a child process found it."""

    version: str | None  # None: llama_cpp does not import
    system_info: str = ""  # llama_print_system_info(): "CPU : SSE3 = 1 | ... | CUDA : ARCHS = 900 | ..."
    gpu_offload: bool = False  # llama_supports_gpu_offload()
    error: str | None = None  # why the probe failed

    @property
    def backends(self) -> list[str]:
        """The backends compiled in that describe themselves in the system info ("CPU", "CUDA", ...)."""
        return [item.split(" : ", 1)[0].strip() for item in self.system_info.split(" | ") if " : " in item]

    @property
    def gpu_backends(self) -> list[str]:
        return [b for b in self.backends if b in GPU_BACKENDS]


def probe_build(python: str = sys.executable, timeout: float = PROBE_TIMEOUT_S) -> Build:
    """Import llama_cpp in a child interpreter and ask it what it can do."""
    try:
        done = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Build(None, error=f"importing llama_cpp took over {timeout:g} s")
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return Build(None, error=lines[-1] if lines else f"the probe exited with {done.returncode}")
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
        return Build(str(answer["version"]), str(answer["system_info"]), bool(answer["gpu_offload"]))
    except (ValueError, KeyError, IndexError):
        return Build(None, error=f"the probe answered {done.stdout[-200:]!r}")


@dataclass(frozen=True)
class Problem:
    what: str
    fix: str


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


def build_problems(build: Build, gpus: Sequence[Device]) -> list[Problem]:
    """What keeps this build from using the GPUs found (simulated GPUs need no build)."""
    real = [d for d in gpus if not d.simulated]
    if build.version is None:
        cuda = f" (with GPUs, the CUDA build: {CUDA_INSTALL})" if real else ""
        return [Problem(f"llama-cpp-python does not load: {build.error}", f"pip install llama-cpp-python{cuda}")]
    if real and not build.gpu_offload:
        if build.gpu_backends:
            return [Problem(f"llama-cpp-python is built with {', '.join(build.gpu_backends)} but finds no GPU, "
                            f"while {_gpu_names(real)} {'is' if len(real) == 1 else 'are'} here",
                            "check the driver (nvidia-smi), CUDA_VISIBLE_DEVICES, and that the driver supports the "
                            "CUDA version the build used; in a container, give it the GPUs (docker run --gpus all, "
                            "or a nvidia.com/gpu resource in Kubernetes)")]
        return [Problem(f"llama-cpp-python is a CPU-only build (backends: {', '.join(build.backends) or 'unknown'}) "
                        f"while {_gpu_names(real)} {'is' if len(real) == 1 else 'are'} here: models would run on "
                        "the CPU", f"install the CUDA build: {CUDA_INSTALL}")]
    if build.gpu_offload and not gpus:
        return [Problem("llama.cpp finds a GPU but mpserve found none (no NVML, no nvidia-smi): instances would "
                        "be placed on the CPU", "pip install 'mpserve[nvml]', or put nvidia-smi on PATH")]
    return []


def start_warnings(config: ServerConfig, devices: Sequence[Device],
                   build: Callable[[], Build] = probe_build) -> list[str]:
    """What ``mpserve start`` warns about before its workers start: GPUs here, a model asking for GPU layers,
    and a build that cannot offload. ``build`` runs only in that case (a child process)."""
    real = [d for d in devices if not d.simulated]
    asking = [m.name for m in config.models
              if m.instances > 0 and m.path != ECHO_MODEL and (m.n_gpu_layers is None or m.n_gpu_layers != 0)]
    if not real or not asking:
        return []
    found = build()
    return [f"{p.what}; model {', '.join(repr(n) for n in asking)} asks for GPU layers (n_gpu_layers), so its "
            f"instances are placed on GPUs they will not use. Fix: {p.fix}. `mpserve doctor` checks the build"
            for p in build_problems(found, real)]


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


def _gpu_names(devices: Sequence[Device]) -> str:
    return ", ".join(f"GPU {d.index} ({d.name})" for d in devices)


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
    try:
        st = path.stat()
    except FileNotFoundError:
        parent = next(p for p in path.parents if p.exists())
        if not os.access(parent, os.W_OK | os.X_OK):
            return Directory("runtime", str(path), "cannot be created", Problem(
                f"runtime directory {path} does not exist and {parent} is not writable",
                "set MPSERVE_RUNTIME_DIR to a folder of yours"))
        return Directory("runtime", str(path), "created, mode 0700, at the first start")
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        return Directory("runtime", str(path), "not private", Problem(
            f"runtime directory {path} must be owned by you and closed to others (its ipc sockets are the "
            "server's doors)", f"chmod 700 {path}, or set MPSERVE_RUNTIME_DIR"))
    return Directory("runtime", str(path), "ok (yours, mode 0700)")


def _lock_directory() -> Directory:
    try:
        path = default_lock_dir()  # created if absent, as every server and `mpserve devices` do
    except ConfigError as exc:
        return Directory("locks", "?", "unusable", Problem(exc.message, "set MPSERVE_LOCK_DIR to a folder of "
                                                                         "yours (mode 0700) that your servers share"))
    return Directory("locks", str(path), "ok (yours, mode 0700; every server of yours on this host must use it)")
