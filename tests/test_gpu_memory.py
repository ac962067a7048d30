"""Live GPU memory from recorded NVML answers (per GPU, per process) in `mpserve devices`, the backend monitor,
/metrics and the server's estimate check; and, on this host, what they show with no NVML: nothing, cleanly."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from fake_nvml import DATA, FakeNvml
from typer.testing import CliRunner

from mpserve.cli import app
from mpserve.gateway.ops.metrics import GatewayMetrics, ServerView
from mpserve.gateway.ops.monitor import monitor
from mpserve.gpu.devices import parse_nvidia_smi, parse_simulated
from mpserve.gpu.memory import EstimateCheck, GpuProcess, GpuUsage, memory_by_pid, read_usage
from mpserve.gpu.placement import Placement
from mpserve.wire import protocol as wire
from mpserve.wire.slots import CacheRow, SlotRow, SlotState

GIB = 1 << 30
ONE_GPU = parse_nvidia_smi((DATA / "nvidia-smi-1gpu.csv").read_text())


@pytest.mark.timeout(10)
def test_usage_per_gpu_and_per_process_from_recorded_nvml() -> None:
    first, second = read_usage(FakeNvml.load("nvml-2gpu-processes.json"))  # type: ignore[misc]
    assert (first.index, first.name, first.total) == (0, "NVIDIA H100 80GB HBM3", 85520809984)
    assert first.used == first.total - first.free == 13043171328
    assert first.processes == (GpuProcess(41021, 6228541440), GpuProcess(41022, 6228541440))
    assert second.processes[1] == GpuProcess(5120, None)  # the driver does not tell
    assert memory_by_pid([first, second]) == {41021: 6228541440, 41022: 6228541440, 41023: 6228541440}


@pytest.mark.timeout(10)
def test_no_process_list_no_nvml_and_no_driver_answer_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [u.processes for u in read_usage(FakeNvml.load("nvml-2gpu.json")) or []] == [(), ()]

    class NoDriver(FakeNvml):
        def nvmlInit(self) -> None:
            raise self.NVMLError("Driver Not Loaded")

    assert read_usage(NoDriver([])) is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert read_usage() is None
    assert memory_by_pid(None) == {}


def row(index: int, pid: int, device: int, worker: int, model: str = "m") -> SlotRow:
    now = time.time()
    return SlotRow(index, pid, worker, index, SlotState.IDLE, device, model, "", 0, 1, now, now, 0.5, 0, 512,
                   CacheRow.empty())


def usage_of(pid: int) -> list[GpuUsage]:
    return [GpuUsage(0, "GPU-a", "NVIDIA H100 80GB HBM3", 80 * GIB, 7 * GIB, 73 * GIB,
                     (GpuProcess(pid, 6 * GIB), GpuProcess(1, GIB)))]


@pytest.mark.timeout(10)
def test_backend_monitor_shows_each_instances_gpu_memory_once() -> None:
    me = os.getpid()  # a live process, so the rows count as running
    rows = [row(0, me, 0, 0), row(1, me, 0, 0), row(2, me, -1, 1, "cpu-model")]  # two slots of one instance
    out = monitor(rows, None, usage_of(me))
    assert [i["gpu_memory_bytes"] for i in out["instances"]] == [6 * GIB, None]
    assert [[s["slot"] for s in i["slots"]] for i in out["instances"]] == [[0, 1], [2]] and out["slots"] == 3
    assert out["gpu_memory_bytes"] == 6 * GIB
    assert out["gpus"][0]["used"] == 7 * GIB and out["gpus"][0]["processes"][0] == {"pid": me, "used": 6 * GIB}
    nothing = monitor(rows, None, None)
    assert [i["gpu_memory_bytes"] for i in nothing["instances"]] == [None] * 2
    assert nothing["gpu_memory_bytes"] == 0 and nothing["gpus"] == []


@pytest.mark.timeout(10)
def test_metrics_carry_gpu_memory_and_each_instances_share() -> None:
    me = os.getpid()
    stats = wire.Stats(0, True, {}, {"m": wire.ModelStats(0, 0, 1, 2)})
    rows = [row(0, me, 0, 0), row(1, me, 0, 0)]
    text = GatewayMetrics().render(ServerView(stats, rows, {}, usage_of(me))).decode()
    assert 'mpserve_gpu_memory_used_bytes{gpu="0",uuid="GPU-a"} 7.516192768e+09' in text
    assert 'mpserve_gpu_memory_free_bytes{gpu="0",uuid="GPU-a"} 7.8383153152e+10' in text
    assert [line for line in text.splitlines() if line.startswith("mpserve_instance_gpu_memory_bytes")] == [
        'mpserve_instance_gpu_memory_bytes{gpu="0",model="m",worker="0"} 6.442450944e+09']
    assert "mpserve_gpu_" not in GatewayMetrics().render(ServerView(stats, rows, {}, None)).decode()


@pytest.mark.timeout(10)
def test_the_estimate_is_logged_once_per_model_beside_what_an_instance_uses(caplog: pytest.LogCaptureFixture) -> None:
    estimate = int(6.1 * GIB)
    placements = [Placement("m", 0, 0, estimate), Placement("m", 1, 0, estimate), Placement("c", 0, None, 0)]
    check = EstimateCheck(placements, ONE_GPU)
    with caplog.at_level(logging.INFO, logger="mpserve.gpu"):
        check.ready(0, 7, {})  # NVML does not know the process: nothing to compare yet
        check.ready(1, 8, {8: int(5.8 * GIB)})
        check.ready(0, 9, {9: GIB})  # a restarted worker: already measured
        check.ready(2, 10, {10: GIB})  # on the CPU
    assert [r.getMessage() for r in caplog.records] == ["model 'm' on gpu0: estimated 6.1 GiB, uses 5.8 GiB"]
    simulated = EstimateCheck(placements, parse_simulated("1x24GiB"))
    simulated.ready(0, 8, None)  # would read NVML if it were a real device
    assert len(caplog.records) == 1


@pytest.mark.timeout(30)
def test_devices_lists_used_memory_and_processes_from_recorded_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MPSERVE_SIMULATE_GPUS", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml.load("nvml-2gpu-processes.json"))
    text = CliRunner().invoke(app, ["devices"]).output
    assert "gpu0  NVIDIA H100 80GB HBM3  67.5 GiB free of 79.6 GiB" in text
    assert "12.1 GiB used; processes: 41021 5.8 GiB, 41022 5.8 GiB" in text and "41023 5.8 GiB, 5120 ?" in text
    rows = json.loads(CliRunner().invoke(app, ["devices", "--json"]).output)
    assert rows[1]["memory_used"] == 85520809984 - 79090941952
    assert rows[1]["processes"] == [{"pid": 41023, "memory": 6228541440}, {"pid": 5120, "memory": None}]


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except urllib.error.URLError:  # not listening yet
        return 0, b""


@pytest.mark.timeout(90)
def test_on_this_host_monitor_and_metrics_report_no_gpu_memory_cleanly(start_server) -> None:
    if read_usage() is not None:
        pytest.skip("NVML answers on this host")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_server("--simulate-gpus", "1x24GiB", "--http", f"127.0.0.1:{port}").wait_ready()
    deadline = time.monotonic() + 30
    while get(f"http://127.0.0.1:{port}/health")[0] != 200:
        assert time.monotonic() < deadline, "the gateway never became healthy"
        time.sleep(0.1)
    status, body = get(f"http://127.0.0.1:{port}/backend/monitor")
    out: dict[str, Any] = json.loads(body)
    assert status == 200 and [i["device"] for i in out["instances"]] == ["gpu0"]
    assert out["instances"][0]["gpu_memory_bytes"] is None and out["gpu_memory_bytes"] == 0 and out["gpus"] == []
    status, body = get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200 and b"mpserve_instances{" in body and b"mpserve_gpu_" not in body
