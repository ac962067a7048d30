"""LoRA adapters through the whole server: four adapters and the base model served at once by 2 instances x
parallel 4, each request's text llama.cpp's own with its adapter at its scale, whichever way the request chose it
(the Python client's model BASE:NAME or adapters, the gateway's lora list), and the instances' active sets shown in
the slot table."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import llama_cpp
import pytest
from conftest import ServerProcess
from engines import PROMPTS, adapters_for
from test_adapters import reference

from mpserve import AsyncClient

NAMES = ("a0", "a1", "a2", "a3")
CHOICES: list[tuple[str, float] | None] = [None, ("a0", 1.0), ("a1", 0.5), ("a2", 1.0), ("a3", -1.5)]


@pytest.fixture(scope="module")
def adapters(tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return adapters_for(tiny_model_path, tmp_path_factory.mktemp("adapters"), NAMES)


@pytest.fixture(scope="module")
def server(adapters: dict[str, str]) -> Iterator[ServerProcess]:
    flags = [arg for name, path in adapters.items() for arg in ("--lora", f"{name}={path}")]
    server = ServerProcess("--model", "builtin:tiny", "--instances", "2", "--parallel", "4", "--threads", "1",
                           "--reuse", "exact", *flags).wait_ready()
    yield server
    server.stop()


@pytest.mark.timeout(240)
def test_four_adapters_and_the_base_at_once_on_two_instances_each_give_llama_cpp_text(
        server: ServerProcess, adapters: dict[str, str], tiny_model_path: str) -> None:
    requests = [(PROMPTS[i % 4], CHOICES[i % 5], 12 + 2 * i) for i in range(20)]
    expected = [reference(llama_cpp.Llama, tiny_model_path, adapters[c[0]] if c else None, c[1] if c else 1.0, p, n)
                for p, c, n in requests]

    async def run() -> list[str]:
        async with AsyncClient(server.address) as client:
            async def one(i: int, prompt: str, choice: tuple[str, float] | None, n: int) -> str:
                params = {"max_tokens": n, "temperature": 0.0}
                if choice is not None and choice[1] == 1.0 and i % 2:  # the model field names it ...
                    result = await client.generate(prompt, model=f"tiny:{choice[0]}", **params)
                else:  # ... or the adapters argument
                    result = await client.generate(prompt, adapters=dict([choice]) if choice else None, **params)
                return result.text
            return await asyncio.gather(*(one(i, *r) for i, r in enumerate(requests)))

    assert asyncio.run(run()) == expected
    base = {p: t for (p, c, _), t in zip(requests, expected, strict=True) if c is None}
    differs = {c: False for c in CHOICES if c is not None}
    for (p, c, _), t in zip(requests, expected, strict=True):
        if c is not None:
            differs[c] |= t[:len(base[p])] != base[p][:len(t)]
    assert all(differs.values())  # each adapter changes greedy text


@pytest.mark.timeout(120)
def test_the_gateway_s_lora_list_gives_the_same_text(server: ServerProcess, adapters: dict[str, str],
                                                      tiny_model_path: str) -> None:
    from gateway_thread import GatewayThread

    gw = GatewayThread(server_name=server.name)
    try:
        for index, scale in ((1, 0.5), (3, -1.5)):
            body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0,
                    "lora": [{"id": index, "scale": scale}]}
            answer = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == reference(
                llama_cpp.Llama, tiny_model_path, adapters[NAMES[index]], scale, PROMPTS[0], 10)
    finally:
        gw.stop()


@pytest.mark.timeout(120)
def test_status_the_console_and_the_monitor_show_each_instance_s_active_sets(
        start_server: type[ServerProcess], adapters: dict[str, str]) -> None:
    flags = [arg for name, path in adapters.items() for arg in ("--lora", f"{name}={path}")]
    server = start_server("--model", "builtin:tiny", "--instances", "2", "--parallel", "4", *flags).wait_ready()
    from gateway_thread import GatewayThread

    from mpserve import Client
    from mpserve.cli import format_table

    gw = GatewayThread(server_name=server.name)
    try:
        with Client(server.address) as client:
            streams = [client.stream(f"hello {i}", adapters={"a1": 0.5}, max_tokens=100000, ignore_eos=True)
                       for i in range(3)]  # running until cancelled, whatever the random weights say
            running = [iter(stream) for stream in streams]  # kept: an iterator dropped cancels its request
            for chunks in running:
                next(chunks)  # running now: routed together, to the instance that runs their set
            shown = format_table(server.info, server.slots())  # what `mpserve status` prints, while they run
            for stream in streams:
                client.cancel(stream.id)
        assert "ADAPTERS" in shown and "adapter sets running: a1*0.5" in shown, shown
        # a slot shows the set its running or last sequence ran under
        monitor = gw.get("/backend/monitor").json()
        shown_sets = [[s["adapters"] for s in i["slots"] if s["adapters"]] for i in monitor["instances"]]
        assert sorted(shown_sets) == [[], ["a1*0.5"] * 3]
        console = gw.get("/console/state").json()
        assert sorted(s["adapters"] for s in console["slots"]) == [""] * 5 + ["a1*0.5"] * 3
        assert console["models"][0]["adapters"] == list(NAMES)
    finally:
        gw.stop()
