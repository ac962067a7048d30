"""GPU discovery from simulated specs, NVML, and nvidia-smi output recorded in tests/data."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from fake_nvml import FakeNvml

from mpserve.errors import ConfigError
from mpserve.gpu.devices import (
    SIMULATE_ENV,
    Device,
    devices_from_nvml,
    discover,
    format_memory,
    parse_memory,
    parse_nvidia_smi,
)

DATA = Path(__file__).parents[1] / "data"
MIB = 1 << 20
GIB = 1 << 30


@pytest.fixture
def no_simulation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SIMULATE_ENV, raising=False)


@pytest.fixture
def fake_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_simulation: None) -> Path:
    """An ``nvidia-smi`` on an otherwise empty PATH; tests fill in its script."""
    if importlib.util.find_spec("pynvml") is not None:
        pytest.skip("pynvml is installed, so discovery asks NVML before nvidia-smi")
    monkeypatch.setenv("PATH", str(tmp_path))
    return tmp_path / "nvidia-smi"


def install(script: Path, body: str) -> None:
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)


@pytest.mark.timeout(10)
def test_nvidia_smi_output_for_one_gpu_parses_to_bytes() -> None:
    [device] = parse_nvidia_smi((DATA / "nvidia-smi-1gpu.csv").read_text())
    assert device == Device(
        0, "NVIDIA GeForce RTX 4090", "GPU-5f3a8c2e-91d4-4b7e-a6c1-3e2d9f0b7a14", 24564 * MIB, 23918 * MIB
    )
    assert device.key == "GPU-5f3a8c2e-91d4-4b7e-a6c1-3e2d9f0b7a14"
    assert not device.simulated


@pytest.mark.timeout(10)
def test_nvidia_smi_output_for_four_gpus_keeps_each_free_memory() -> None:
    devices = parse_nvidia_smi((DATA / "nvidia-smi-4gpu.csv").read_text())
    assert [d.index for d in devices] == [0, 1, 2, 3]
    assert {d.name for d in devices} == {"NVIDIA A100-SXM4-80GB"}
    assert [d.memory_free // MIB for d in devices] == [81050, 40211, 81050, 3]
    assert len({d.key for d in devices}) == 4


@pytest.mark.timeout(10)
def test_malformed_nvidia_smi_line_is_a_config_error_naming_the_line() -> None:
    with pytest.raises(ConfigError, match="line 2"):
        parse_nvidia_smi("0, GPU, GPU-a, 100, 50\n1, GPU, GPU-b, [N/A], [N/A]\n")


@pytest.mark.timeout(10)
def test_nvml_devices_come_from_the_module_passed_in() -> None:
    recorded = json.loads((DATA / "nvml-2gpu.json").read_text())
    nvml = FakeNvml(recorded)
    devices = devices_from_nvml(nvml)
    assert devices == [Device(index, r["name"], r["uuid"], r["total"], r["free"]) for index, r in enumerate(recorded)]
    assert not nvml.running  # shut down again


@pytest.mark.timeout(10)
def test_nvml_without_a_driver_means_no_answer_from_nvml() -> None:
    assert devices_from_nvml(FakeNvml([], driver_loaded=False)) is None


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("24GiB", 24 * GIB),
        ("512MiB", 512 * MIB),
        ("7GB", 7 * 10**9),
        ("1024", 1024),
        ("1.5 GiB", 3 * GIB // 2),
        ("64kib", 64 << 10),
        ("2TB", 2 * 10**12),
        ("100B", 100),
    ],
)
def test_memory_sizes_parse_in_binary_and_decimal_units(text: str, size: int) -> None:
    assert parse_memory(text) == size


@pytest.mark.timeout(10)
@pytest.mark.parametrize("text", ["", "GiB", "24 GiBs", "-1GiB", "24G", "lots"])
def test_bad_memory_sizes_name_the_value_and_the_allowed_forms(text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_memory(text)
    assert repr(text) in caught.value.message
    assert "GiB" in caught.value.message and "GB" in caught.value.message


@pytest.mark.timeout(10)
def test_format_memory_uses_binary_units() -> None:
    assert [format_memory(n) for n in (96, 1536, 512 * MIB, int(7.2 * GIB))] == [
        "96 B",
        "1.5 KiB",
        "512.0 MiB",
        "7.2 GiB",
    ]


@pytest.mark.timeout(10)
def test_simulated_gpus_from_the_argument_and_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SIMULATE_ENV, "24GiB,16GiB")
    from_env = discover()
    assert [(d.index, d.memory_total, d.memory_free) for d in from_env] == [
        (0, 24 * GIB, 24 * GIB),
        (1, 16 * GIB, 16 * GIB),
    ]
    assert all(d.simulated for d in from_env)
    from_argument = discover(simulate="2x8GiB,4GiB")  # the argument wins over the environment
    assert [d.memory_total // GIB for d in from_argument] == [8, 8, 4]
    assert [d.key for d in from_argument] == ["SIM-0", "SIM-1", "SIM-2"]


@pytest.mark.timeout(10)
def test_bad_simulated_spec_names_the_spec() -> None:
    with pytest.raises(ConfigError, match="'2x'"):
        discover(simulate="2x")


@pytest.mark.timeout(10)
def test_allowed_indices_restrict_and_unknown_ones_name_what_exists() -> None:
    assert [d.index for d in discover([2, 0], simulate="3x1GiB")] == [0, 2]
    with pytest.raises(ConfigError, match=r"GPU 5 is not on this host; it has GPU 0 .*GPU 1"):
        discover([0, 5], simulate="2x1GiB")


@pytest.mark.timeout(10)
def test_discovery_reads_nvidia_smi_on_the_path(fake_nvidia_smi: Path) -> None:
    recorded = DATA / "nvidia-smi-4gpu.csv"
    install(
        fake_nvidia_smi,
        f'[ "$1" = "--query-gpu=index,name,uuid,memory.total,memory.free" ] || exit 2\n'
        f"while IFS= read -r line; do echo \"$line\"; done < '{recorded}'",
    )
    assert discover() == parse_nvidia_smi(recorded.read_text())
    assert [d.index for d in discover([1, 3])] == [1, 3]


@pytest.mark.timeout(10)
def test_failing_nvidia_smi_means_a_cpu_only_host(fake_nvidia_smi: Path) -> None:
    install(fake_nvidia_smi, "echo 'NVIDIA-SMI has failed because it could not communicate with the driver'; exit 9")
    assert discover() == []


@pytest.mark.timeout(10)
def test_no_gpu_tools_means_a_cpu_only_host(fake_nvidia_smi: Path) -> None:
    assert discover() == []
    with pytest.raises(ConfigError, match="it has no GPUs"):
        discover([0])


@pytest.mark.timeout(10)
def test_device_key_is_a_safe_file_name() -> None:
    assert Device(0, "x", "MIG-GPU-1/2/3", 1, 1).key == "MIG-GPU-1_2_3"
    assert Device(3, "x", "", 1, 1).key == "gpu3"
