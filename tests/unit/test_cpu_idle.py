"""Idle CPU time this process could use: its CPUs' lines of /proc/stat, and its cgroup's quota (v1 and v2)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from mpserve.server.cpu_idle import CpuIdle

pytestmark = pytest.mark.timeout(10)

TICK = os.sysconf("SC_CLK_TCK")

STAT = ("cpu  40 0 20 900 10 0 0 0 0 0\n"
        "cpu0 10 0 5 300 3 0 0 0 0 0\n"
        "cpu1 10 0 5 200 2 0 0 0 0 0\n"
        "cpu2 20 0 10 400 5 0 0 0 0 0\n"
        "intr 12345 0 0\n")


@pytest.fixture
def stat(tmp_path: Path) -> Path:
    path = tmp_path / "stat"
    path.write_text(STAT)
    return path


def _no_cgroup(tmp_path: Path) -> str:
    path = tmp_path / "cgroup"
    path.write_text("0::/\n")
    return str(path)


def test_only_the_cpus_this_process_may_run_on_count(stat: Path, tmp_path: Path) -> None:
    idle = CpuIdle(str(stat), _no_cgroup(tmp_path), str(tmp_path / "fs"), cpus={0, 2}).seconds()
    assert idle == pytest.approx(((300 + 3 + 400 + 5) / TICK,))


def test_without_a_stat_file_nothing_is_known(tmp_path: Path) -> None:
    assert CpuIdle(str(tmp_path / "missing"), _no_cgroup(tmp_path), str(tmp_path), cpus={0}).seconds() is None


def test_a_v2_quota_is_a_second_source_quota_times_time_minus_usage(stat: Path, tmp_path: Path) -> None:
    group = tmp_path / "fs" / "kubepods" / "pod1"
    group.mkdir(parents=True)
    (group / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs
    (group / "cpu.stat").write_text("usage_usec 2000000\nuser_usec 1500000\nsystem_usec 500000\n")
    cgroup = tmp_path / "cgroup"
    cgroup.write_text("0::/kubepods/pod1\n")
    before = time.monotonic()
    cpus, quota = CpuIdle(str(stat), str(cgroup), str(tmp_path / "fs"), cpus={0}).seconds() or ()
    after = time.monotonic()
    assert cpus == pytest.approx(303 / TICK)
    assert 1.5 * before - 2.0 <= quota <= 1.5 * after - 2.0


def test_no_v2_quota_is_no_second_source(stat: Path, tmp_path: Path) -> None:
    group = tmp_path / "fs"
    group.mkdir()
    (group / "cpu.max").write_text("max 100000\n")
    cgroup = tmp_path / "cgroup"
    cgroup.write_text("0::/\n")
    assert CpuIdle(str(stat), str(cgroup), str(group), cpus={0}).seconds() == pytest.approx((303 / TICK,))


def test_a_v1_quota_reads_cfs_files_and_cpuacct_usage(stat: Path, tmp_path: Path) -> None:
    root = tmp_path / "fs"
    (root / "cpu" / "docker" / "c1").mkdir(parents=True)
    (root / "cpuacct" / "docker" / "c1").mkdir(parents=True)
    (root / "cpu" / "docker" / "c1" / "cpu.cfs_quota_us").write_text("200000\n")
    (root / "cpu" / "docker" / "c1" / "cpu.cfs_period_us").write_text("100000\n")
    (root / "cpuacct" / "docker" / "c1" / "cpuacct.usage").write_text("3000000000\n")  # 3 s, in ns
    cgroup = tmp_path / "cgroup"
    cgroup.write_text("4:memory:/docker/c1\n3:cpu,cpuacct:/docker/c1\n0::/\n")
    before = time.monotonic()
    _, quota = CpuIdle(str(stat), str(cgroup), str(root), cpus={0}).seconds() or ()
    assert 2 * before - 3.0 <= quota <= 2 * time.monotonic() - 3.0


def test_a_v1_cgroup_without_a_quota_is_no_second_source(stat: Path, tmp_path: Path) -> None:
    root = tmp_path / "fs"
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    cgroup = tmp_path / "cgroup"
    cgroup.write_text("1:cpu:/\n")
    assert CpuIdle(str(stat), str(cgroup), str(root), cpus={1}).seconds() == pytest.approx((202 / TICK,))


def test_this_host() -> None:
    if not Path("/proc/stat").exists():
        pytest.skip("/proc/stat is Linux's")
    idle = CpuIdle().seconds()
    assert idle is not None and idle[0] > 0
