"""`mpserve doctor` and the same check at `mpserve start`: the real build and GPUs of this host, GPUs from
recorded NVML and nvidia-smi answers, and builds given as facts (a CPU-only one, a CUDA one without a device)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from fake_nvml import DATA, FakeNvml
from helpers import mpserve

from mpserve.config import loader as cfg
from mpserve.doctor import collect, format_report
from mpserve.gpu.devices import discover, parse_nvidia_smi, parse_simulated
from mpserve.llama_build import CUDA_INSTALL, Build, build_problems, probe_build, start_warnings

CPU_BUILD = Build("0.3.0", "CPU : SSE3 = 1 | AVX2 = 1 | OPENMP = 1 | ", gpu_offload=False)
CUDA_BUILD = Build("0.3.0", "CPU : SSE3 = 1 | AVX2 = 1 | CUDA : ARCHS = 900 | USE_GRAPHS = 1 | ", gpu_offload=True)
CUDA_BUILD_NO_DEVICE = Build(CUDA_BUILD.version, CUDA_BUILD.system_info, gpu_offload=False)
NO_BUILD = Build(None, error="ModuleNotFoundError: No module named 'llama_cpp'")
ONE_GPU = parse_nvidia_smi((DATA / "nvidia-smi-1gpu.csv").read_text())


def no_probe() -> Build:
    raise AssertionError("the build was probed although nothing asks for a GPU")


@pytest.fixture
def recorded_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An ``nvidia-smi`` first on PATH that prints the recorded answer of a host with four A100s; returns PATH."""
    if importlib.util.find_spec("pynvml") is not None:
        pytest.skip("pynvml is installed, so discovery asks NVML before nvidia-smi")
    monkeypatch.delenv("MPSERVE_SIMULATE_GPUS", raising=False)
    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!/bin/sh\ncat '{DATA / 'nvidia-smi-4gpu.csv'}'\n")
    script.chmod(0o755)
    path = f"{tmp_path}:{os.environ.get('PATH', '')}"
    monkeypatch.setenv("PATH", path)
    return path


def doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return mpserve("doctor", *args, env=env)


@pytest.mark.timeout(60)
def test_doctor_reports_this_hosts_build_and_gpus() -> None:
    done = doctor("--json")
    report = json.loads(done.stdout)
    build = report["build"]
    assert build["version"] == importlib.metadata.version("llama_cpp_python")
    assert "CPU" in build["backends"] and "CPU :" in build["system_info"]
    assert report["gpus"] == [asdict(d) for d in discover()]
    assert [d["role"] for d in report["directories"]] == ["runtime", "locks"]
    if report["gpus"]:
        pytest.skip("this host has GPUs; the rest checks a CPU-only host")
    # llama_supports_gpu_offload needs a GPU device, whatever the build: none here
    assert build["gpu_offload"] is False and report["gpu_source"] == "none"
    assert report["problems"] == [] and done.returncode == 0
    text = doctor().stdout
    assert f"llama-cpp-python {build['version']}; backends: {', '.join(build['backends'])}; GPU offload: no" in text
    assert "GPUs: none found" in text and "no problems found" in text


@pytest.mark.timeout(60)
def test_doctor_with_recorded_gpus_and_this_cpu_build_names_the_cuda_build(recorded_nvidia_smi: str) -> None:
    if probe_build().gpu_offload:
        pytest.skip("this host's llama.cpp build can offload")
    done = doctor(env={"PATH": recorded_nvidia_smi})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "GPUs (nvidia-smi)" in done.stdout and "gpu3  NVIDIA A100-SXM4-80GB" in done.stdout
    assert "CPU-only build" in done.stdout and f"fix: install the CUDA build: {CUDA_INSTALL}" in done.stdout


@pytest.mark.timeout(30)
def test_recorded_nvidia_smi_gpus_are_reported_with_their_free_memory(recorded_nvidia_smi: str) -> None:
    report = collect(build=CUDA_BUILD)
    assert report.gpu_source == "nvidia-smi" and [d.index for d in report.gpus] == [0, 1, 2, 3]
    assert report.problems == []
    assert any("mpserve[nvml]" in note for note in report.notes)
    text = format_report(report)
    assert "gpu3  NVIDIA A100-SXM4-80GB  GPU-0f1e2d3c-4b5a-6978-8a9b-c0d1e2f3a4b5  3.0 MiB free of 80.0 GiB" in text
    assert "no problems found" in text


@pytest.mark.timeout(30)
def test_recorded_nvml_gpus_with_a_cuda_build_that_sees_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MPSERVE_SIMULATE_GPUS", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml.load("nvml-2gpu.json"))
    assert collect(build=CUDA_BUILD).problems == []
    report = collect(build=CUDA_BUILD_NO_DEVICE)
    assert report.gpu_source == "NVML" and [d.name for d in report.gpus] == ["NVIDIA H100 80GB HBM3"] * 2
    [problem] = report.problems
    assert "built with CUDA but finds no GPU" in problem.what and "GPU 1 (NVIDIA H100 80GB HBM3)" in problem.what
    assert "CUDA_VISIBLE_DEVICES" in problem.fix and "--gpus all" in problem.fix


@pytest.mark.timeout(10)
def test_backends_come_from_the_system_info() -> None:
    assert CPU_BUILD.backends == ["CPU"] and CPU_BUILD.gpu_backends == []
    assert CUDA_BUILD.backends == ["CPU", "CUDA"] and CUDA_BUILD.gpu_backends == ["CUDA"]


@pytest.mark.timeout(10)
def test_build_problems_and_their_fixes() -> None:
    [cpu_only] = build_problems(CPU_BUILD, ONE_GPU)
    assert "CPU-only build (backends: CPU)" in cpu_only.what and CUDA_INSTALL in cpu_only.fix
    [missing] = build_problems(NO_BUILD, ONE_GPU)
    assert "No module named 'llama_cpp'" in missing.what and CUDA_INSTALL in missing.fix
    [unseen] = build_problems(CUDA_BUILD, [])
    assert "mpserve found none" in unseen.what and "mpserve[nvml]" in unseen.fix
    assert build_problems(CPU_BUILD, parse_simulated("2x24GiB")) == []  # pretend GPUs need no build
    assert build_problems(CPU_BUILD, []) == []
    assert build_problems(CUDA_BUILD, ONE_GPU) == []


def config(**model: object) -> cfg.ServerConfig:
    return cfg.build(model={"path": "builtin:tiny", **model})


@pytest.mark.timeout(10)
def test_start_warns_when_a_model_asks_for_gpu_layers_and_the_build_cannot_offload() -> None:
    for asking in (config(), config(n_gpu_layers=99)):  # the default puts every layer on the GPU
        [warning] = start_warnings(asking, ONE_GPU, lambda: CPU_BUILD)
        assert "CPU-only build" in warning and "GPU 0 (NVIDIA GeForce RTX 4090)" in warning
        assert "model 'tiny' asks for GPU layers" in warning and CUDA_INSTALL in warning
    assert start_warnings(config(), ONE_GPU, lambda: CUDA_BUILD) == []


@pytest.mark.timeout(10)
def test_start_probes_nothing_unless_a_real_gpu_is_asked_for() -> None:
    assert start_warnings(config(), [], no_probe) == []
    assert start_warnings(config(), parse_simulated("1x24GiB"), no_probe) == []
    assert start_warnings(config(n_gpu_layers=0), ONE_GPU, no_probe) == []
    assert start_warnings(config(path="echo"), ONE_GPU, no_probe) == []


@pytest.mark.timeout(90)
def test_mpserve_start_on_recorded_gpus_with_this_cpu_build_logs_the_warning(start_server,
                                                                             recorded_nvidia_smi: str) -> None:
    if probe_build().gpu_offload:
        pytest.skip("this host's llama.cpp build can offload")
    server = start_server("--n-gpu-layers", "99", env={"PATH": recorded_nvidia_smi}).wait_ready()
    warnings = [i for i, line in enumerate(server.log) if "WARNING" in line and "CPU-only build" in line]
    ready = next(i for i, line in enumerate(server.log) if "ready:" in line)
    assert len(warnings) == 1 and warnings[0] < ready, "\n".join(server.log)
    assert CUDA_INSTALL in server.log[warnings[0]]


@pytest.mark.timeout(60)
def test_doctor_says_how_each_models_instances_start_and_why(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("models:\n  - path: builtin:tiny\n    name: m\n  - path: echo\n    name: e\n")
    text = doctor("--config", str(config)).stdout
    assert "  m: zygote (the model is loaded once" in text and "  e: fork server (the echo backend" in text
    text = doctor("--config", str(config), "--simulate-gpus", "1x24GiB").stdout
    assert "  m: fork server (GPU layers: CUDA cannot be used across a fork" in text
    spawned = json.loads(doctor("--json", "--config", str(config), "--start-method", "spawn").stdout)
    assert set(spawned["start_modes"].values()) == {"fork server (start_method: spawn; each instance loads the model)"}


def test_doctor_prints_the_repack_verdict_once(tmp_path: Path) -> None:
    # a host whose probe found the repacked kernels crashing, as its cached verdict says (no probe is run)
    from mpserve import repack

    crashed = repack.Verdict(False, "SIGSEGV at the first decode of Q4_0 weights", repack.host_key())
    (tmp_path / f"repack-{repack.host_key()}.json").write_text(json.dumps(
        {"version": repack.CACHE_VERSION, **asdict(crashed), "cached": True}))
    done = doctor(env={"MPSERVE_CACHE_DIR": str(tmp_path)})
    assert (done.stdout + done.stderr).count(crashed.summary) == 1, done.stdout + done.stderr
