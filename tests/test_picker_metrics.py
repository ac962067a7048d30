"""The model-server protocol's metrics on /metrics, as the inference gateway's endpoint picker reads them: parsed by
prometheus_client's text parser, each one present with the type the protocol gives, one series each, and moving
with the load: a burst of more requests than slots queues some, their adapters show as running, the KV usage
rises, and all of it falls back when they end."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from conftest import ServerProcess
from engines import PROMPTS, adapters_for
from gateway_thread import GatewayThread
from helpers import wait_for
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from mpserve import AsyncClient
from mpserve.gateway.ops.picker_metrics import CACHE_INFO, KV_USAGE, LORA_INFO, RUNNING, WAITING
from mpserve.wire.kv_events import BLOCK_SIZE

SLOTS = 2
BURST = 6  # more requests than slots: BURST - SLOTS of them wait in the queue
LONG = 3000  # tokens each generates (EOS ignored): they run until the test cancels them


@pytest.fixture(scope="module")
def served(tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess,
                                                                                               GatewayThread]]:
    adapters = adapters_for(tiny_model_path, tmp_path_factory.mktemp("adapters"), ("a0", "a1"))
    flags = [arg for name, path in adapters.items() for arg in ("--lora", f"{name}={path}")]
    server = ServerProcess("--model", "builtin:tiny", "--instances", "1", "--parallel", str(SLOTS), "--threads", "1",
                           "--n-ctx", "4096", *flags).wait_ready()
    gw = GatewayThread(server_name=server.name)
    yield server, gw
    gw.stop()
    server.stop()


def families(gw: GatewayThread) -> dict[str, Metric]:
    return {family.name: family for family in text_string_to_metric_families(gw.get("/metrics").text)}


def value(gw: GatewayThread, name: str) -> float:
    (sample,) = families(gw)[name].samples
    return sample.value


@pytest.mark.timeout(120)
def test_each_protocol_metric_is_one_gauge_and_idle_reads_zero(served: tuple[ServerProcess, GatewayThread]) -> None:
    _, gw = served
    found = families(gw)
    for name in (WAITING, RUNNING, KV_USAGE, LORA_INFO, CACHE_INFO):
        assert found[name].type == "gauge", name
        assert len(found[name].samples) == 1, name  # the picker reads one series per pod
    assert value(gw, WAITING) == value(gw, RUNNING) == 0
    assert value(gw, KV_USAGE) == 0  # an idle slot's cells count as free
    (lora,) = found[LORA_INFO].samples
    assert lora.labels == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "2"}
    (config,) = found[CACHE_INFO].samples
    assert config.labels == {"block_size": str(BLOCK_SIZE), "num_gpu_blocks": str(SLOTS * 4096 // BLOCK_SIZE)}


@pytest.mark.timeout(180)
def test_a_burst_queues_its_surplus_and_shows_its_adapters_running(
        served: tuple[ServerProcess, GatewayThread]) -> None:
    server, gw = served
    stop = threading.Event()

    async def burst() -> None:
        async with AsyncClient(server.address) as client:
            tasks = [asyncio.create_task(client.generate(PROMPTS[i % 4], model="tiny:a0",
                                                         max_tokens=LONG, ignore_eos=True, temperature=0.0))
                     for i in range(BURST)]
            while not stop.is_set():
                await asyncio.sleep(0.05)  # not a wait: hands the loop to the requests until the test is done
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    runner = threading.Thread(target=asyncio.run, args=(burst(),))
    runner.start()
    try:
        wait_for(lambda: value(gw, RUNNING) == SLOTS and value(gw, WAITING) == BURST - SLOTS, 60,
                 "every slot running and the rest of the burst queued")
        wait_for(lambda: value(gw, KV_USAGE) > 0, 30, "the running sequences' cells counted")
        assert value(gw, KV_USAGE) <= 1
        (lora,) = families(gw)[LORA_INFO].samples
        assert lora.labels["running_lora_adapters"] == "a0"  # the burst's adapter
        assert lora.labels["waiting_lora_adapters"] == "a0"  # its queued surplus asks for it too
        assert lora.value > 0
    finally:
        stop.set()
        runner.join(60)
    wait_for(lambda: value(gw, RUNNING) == value(gw, WAITING) == 0, 60, "the cancelled burst gone")
    assert value(gw, KV_USAGE) == 0
    assert families(gw)[LORA_INFO].samples[0].labels["running_lora_adapters"] == ""
    assert families(gw)[LORA_INFO].samples[0].labels["waiting_lora_adapters"] == ""
