"""The host RAM check of the instances that run on the CPU (mpserve.server.host_ram): weights once when the
instances share them, each instance's KV cache and buffers, the host store once, against what is available."""

from __future__ import annotations

import pytest

from mpserve.errors import ModelDoesNotFit
from mpserve.gpu.placement import MemoryEstimate
from mpserve.server.host_ram import Available, RamNeed, available_ram, check_ram, format_ram

pytestmark = pytest.mark.timeout(10)

MIB = 1 << 20


def need(instances: int = 2, shared: bool = True, weights: int = 1000, kv: int = 100, parallel: int = 2,
         host_store: int = 256) -> RamNeed:
    return RamNeed("m", instances, MemoryEstimate(weights * MIB, kv * MIB, 50 * MIB), shared, host_store * MIB,
                   parallel, 4096)


def test_shared_weights_count_once_and_a_copy_per_instance_counts_each() -> None:
    assert need(shared=True).resident == (1000 + 2 * 150) * MIB
    assert need(shared=False).resident == (2 * 1000 + 2 * 150) * MIB


def test_what_must_be_resident_and_does_not_fit_is_refused_with_its_parts_and_the_lever_first() -> None:
    with pytest.raises(ModelDoesNotFit) as refused:
        check_ram([need(shared=False)], Available(2000 * MIB, "ram_budget"))
    message = refused.value.message
    for part in ("2.2 GiB of host RAM", "weights 1000.0 MiB × 2", "KV cache 100.0 MiB for parallel 2 × n_ctx 4096",
                 "2.0 GiB is available (ram_budget)", "start_method: fork"):
        assert part in message, message
    with pytest.raises(ModelDoesNotFit) as refused:  # the KV cache is most of it: parallel and n_ctx first
        check_ram([need(instances=4, weights=100, kv=2000, parallel=8)], Available(4000 * MIB, "MemAvailable"))
    assert "try for model 'm' a smaller parallel (now 8) or n_ctx (now 4096)" in refused.value.message


def test_a_host_store_that_may_not_fit_warns_once_for_the_host_and_what_fits_says_nothing() -> None:
    [warning] = check_ram([need()], Available(1400 * MIB, "MemAvailable"))  # 1,300 resident + one store of 256
    assert "host store may grow to 256.0 MiB" in warning and "cache_ram" in warning
    [warning] = check_ram([need(), need(host_store=512)], Available(3000 * MIB, "MemAvailable"))  # the largest
    assert "host store may grow to 512.0 MiB" in warning
    assert check_ram([need()], Available(1600 * MIB, "MemAvailable")) == []  # not 2 × 256: one store per host
    assert check_ram([need()], Available(8000 * MIB, "MemAvailable")) == []
    assert check_ram([], Available(1, "ram_budget")) == [] and check_ram([need()], None) == []


def test_the_budget_caps_what_the_host_has_and_plan_prints_the_parts() -> None:
    host = available_ram()
    assert host is not None and host.bytes > 0  # /proc/meminfo (or the cgroup's headroom)
    assert available_ram(MIB) == Available(MIB, "ram_budget")
    roomy = available_ram(1 << 60)  # the host's own figure, read again: it moves as other processes allocate
    assert roomy is not None and roomy.source == host.source and 0 < roomy.bytes < 1 << 60
    lines = format_ram([need()], Available(8000 * MIB, "MemAvailable")).splitlines()
    assert lines[0].startswith("model 'm', 2 instances: weights 1000.0 MiB once, shared by its instances")
    assert lines[1] == "host RAM: 1.3 GiB planned, 1.5 GiB with a full host store, of 7.8 GiB available (MemAvailable)"
