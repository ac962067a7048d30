"""The installed llama.cpp build, as a child process finds it, and what keeps it from using the GPUs found:
``mpserve doctor`` reports it, ``mpserve start`` and ``mpserve worker`` warn with it (``start_warnings``).

    probe_build ── a child ``python -c`` imports llama_cpp ──▶ Build: version, system info, backends, can offload
    build_problems(Build, GPUs) ──▶ each Problem with its fix (a CPU-only build beside a GPU, a GPU build that
                                    sees none, a GPU llama.cpp sees and mpserve does not)
    start_warnings(config, GPUs) ──▶ the same problems, said for the models asking for GPU layers

The build is probed in a child process: importing llama_cpp loads llama.cpp and, in a CUDA build, the CUDA
runtime, which a server process never does (its workers do), and a broken build then fails the child, not
the caller. ``llama_supports_gpu_offload`` is true only when a GPU backend is compiled in *and* finds a
device, so the system info (the backends compiled in) tells a CPU-only build from a CUDA build that sees no
GPU. ``start_warnings`` probes the build only when real (not simulated) GPUs were found and a model asks for
GPU layers, so a CPU host pays nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mpserve import children
from mpserve.config.loader import ECHO_MODEL, ServerConfig
from mpserve.gpu.devices import Device

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
        done = subprocess.run(children.python("-c", PROBE, executable=python), capture_output=True, text=True,
                              timeout=timeout)
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


def _gpu_names(devices: Sequence[Device]) -> str:
    return ", ".join(f"GPU {d.index} ({d.name})" for d in devices)
