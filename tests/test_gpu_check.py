"""`python -m bench.gpu_check` measures a real GPU: without one, or with a build that cannot offload to it, it
refuses at once and says why (the measurements themselves need a GPU host)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_nvml import DATA

from mpserve.gpu.devices import discover
from mpserve.llama_build import CUDA_INSTALL, probe_build

ROOT = Path(__file__).parent.parent


def gpu_check(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.gpu_check"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env={**os.environ, **env})


@pytest.mark.timeout(60)
def test_without_a_gpu_the_check_refuses() -> None:
    if discover():
        pytest.skip("this host has GPUs")
    done = gpu_check({})
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: no GPU found (NVML, then nvidia-smi)")
    simulated = gpu_check({"MPSERVE_SIMULATE_GPUS": "1x24GiB"})
    assert simulated.returncode == 2 and "simulated GPUs" in simulated.stderr


@pytest.mark.timeout(60)
def test_with_a_gpu_and_a_cpu_only_build_the_check_refuses_with_the_fix(tmp_path: Path) -> None:
    if importlib.util.find_spec("pynvml") is not None or probe_build().gpu_offload:
        pytest.skip("NVML would answer before nvidia-smi, or this build can offload")
    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!/bin/sh\ncat '{DATA / 'nvidia-smi-1gpu.csv'}'\n")
    script.chmod(0o755)
    done = gpu_check({"PATH": f"{tmp_path}:{os.environ['PATH']}", "MPSERVE_SIMULATE_GPUS": ""})
    assert done.returncode == 2 and "CPU-only build" in done.stderr and CUDA_INSTALL in done.stderr
    wrong = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--gpu", "3"], capture_output=True, text=True,
                           timeout=60, cwd=ROOT, env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert wrong.returncode == 2 and "GPU 3 is not on this host" in wrong.stderr
