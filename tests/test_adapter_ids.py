"""A LoRA adapter's id (llama-server's ``lora: [{"id": N}]``) names one adapter for the server's life: after an unload
and a load, the adapters left keep theirs, the new one gets an id never given, and the unloaded one's id is a 400
naming it, never another adapter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess
from gateway_thread import GatewayThread
from helpers import mpserve, write_adapter

from mpserve import Client


@pytest.fixture
def gateway(start_server: type[ServerProcess], tmp_path: Path) -> Iterator[tuple[ServerProcess, GatewayThread]]:
    files = {name: str(write_adapter(tmp_path / f"{name}.gguf")) for name in ("french", "support", "german")}
    server = start_server("--model", "builtin:tiny", "--lora", f"french={files['french']}",
                          "--lora", f"support={files['support']}").wait_ready()
    with Client(server.admin) as admin:
        admin.adapter("unload", "tiny", "french")
        admin.adapter("load", "tiny", "german", files["german"])
    gw = GatewayThread(server_name=server.name)
    yield server, gw
    gw.stop()


def _requests_of(gw: GatewayThread, adapter: str) -> float:
    return gw.metrics().get(("mpserve_adapter_requests_total", (("adapter", adapter), ("model", "tiny"))), 0.0)


@pytest.mark.timeout(120)
def test_ids_survive_an_unload_and_a_load(gateway: tuple[ServerProcess, GatewayThread]) -> None:
    server, gw = gateway
    with Client(server.address) as client:
        assert client.stats().models["tiny"].served_adapters() == {"support": 1, "german": 2}
    listed = mpserve("adapters", "list", "--server-name", server.name)
    assert listed.returncode == 0 and listed.stdout.split("\n")[:2] == ["tiny:support (id 1)", "tiny:german (id 2)"]
    for index, name in ((1, "support"), (2, "german")):
        before = _requests_of(gw, name)
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "lora": [{"id": index}]}
        answer = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        assert _requests_of(gw, name) == before + 1  # served under the adapter of that id, not another


@pytest.mark.timeout(120)
@pytest.mark.parametrize("index", [0, 3])
def test_an_id_no_adapter_has_is_a_400_naming_it(gateway: tuple[ServerProcess, GatewayThread], index: int) -> None:
    _, gw = gateway
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "lora": [{"id": index}]}
    answer = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "bad_request" and f"no LoRA adapter with id {index}" in error["message"]
    assert "served adapters: tiny:support (id 1), tiny:german (id 2)" in error["message"]
