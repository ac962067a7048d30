"""LoRA adapters loaded and unloaded while the server serves: every instance gets the new adapter (its requests then
give llama.cpp's text), an unload waits for the requests using the adapter, and under a steady load of requests
none fails; the admin API and `mpserve adapters` do the same."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import pytest
from conftest import ServerProcess
from engines import PROMPTS, adapters_for
from helpers import mpserve
from test_adapters import reference

from mpserve import Client
from mpserve.errors import BadRequest, MpserveError, UnknownAdapter

NAMES = ("a0", "a1", "a2")


@pytest.fixture(scope="module")
def adapters(tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return adapters_for(tiny_model_path, tmp_path_factory.mktemp("adapters"), NAMES)


@pytest.fixture
def server(start_server: type[ServerProcess], adapters: dict[str, str]) -> Iterator[ServerProcess]:
    yield start_server("--model", "builtin:tiny", "--instances", "2", "--parallel", "2", "--threads", "1",
                       "--reuse", "exact", "--lora", f"a0={adapters['a0']}").wait_ready()


class Load:
    """Requests sent one after another from a few threads until stopped, each under the adapters ``choose`` gives
    for it; every failure kept."""

    def __init__(self, address: str, choose: list[dict[str, float] | None], lanes: int = 3) -> None:
        self.choose, self.failures, self.done = choose, list[str](), 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._lane, args=(address, k), daemon=True) for k in range(lanes)]
        for t in self._threads:
            t.start()

    def _lane(self, address: str, k: int) -> None:
        with Client(address) as client:
            i = k
            while not self._stop.is_set():
                choice = self.choose[i % len(self.choose)]
                try:
                    client.generate(PROMPTS[i % 4], adapters=choice, max_tokens=24, temperature=0)
                    self.done += 1
                except MpserveError as exc:
                    self.failures.append(f"{choice}: {exc}")
                i += 3

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


@pytest.mark.timeout(180)
def test_an_adapter_loaded_and_unloaded_under_load_fails_no_request(server: ServerProcess, adapters: dict[str, str],
                                                                    tiny_model_path: str) -> None:
    load = Load(server.address, [None, {"a0": 1.0}])
    with Client(server.admin) as admin, Client(server.address) as client:
        loaded = admin.adapter("load", "tiny", "a1", adapters["a1"])
        assert loaded.op == "load" and set(loaded.adapters) == {"a0", "a1"}
        with pytest.raises(BadRequest, match="serves adapter 'a1' already"):
            admin.adapter("load", "tiny", "a1", adapters["a1"])
        for _ in range(4):  # on either instance: each has it
            assert client.generate(PROMPTS[1], adapters={"a1": 0.5}, max_tokens=10, temperature=0).text == \
                reference(llama_cpp.Llama, tiny_model_path, adapters["a1"], 0.5, PROMPTS[1], 10)
        load.choose = [None, {"a1": 1.0}]  # a0's requests end; the unload waits for those still running
        unloaded = admin.adapter("unload", "tiny", "a0")
        assert unloaded.op == "unload" and "a0" not in unloaded.adapters
        with pytest.raises(UnknownAdapter, match="served adapters: tiny:a1"):
            client.generate("hi", adapters=["a0"], max_tokens=2)
    served = load.done
    load.stop()
    assert not load.failures and served > 0


@pytest.mark.timeout(120)
def test_the_cli_and_the_admin_api_load_list_and_unload(server: ServerProcess, adapters: dict[str, str]) -> None:
    from gateway_thread import GatewayThread

    name = ["--server-name", server.name]
    listed = mpserve("adapters", "list", *name)
    assert listed.returncode == 0 and "tiny:a0" in listed.stdout, listed.stderr
    done = mpserve("adapters", "load", "tiny", "a2", adapters["a2"], *name)
    assert done.returncode == 0 and "loaded adapter 'a2' of model 'tiny'" in done.stdout, done.stderr
    junk = Path(adapters["a2"]).parent / "not-a-lora.gguf"  # in a folder hot loads may read (adapter_dir)
    junk.write_bytes(b"not a GGUF")
    bad = mpserve("adapters", "load", "tiny", "a9", str(junk), *name)
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1 and "LoRA" in bad.stderr, bad.stderr
    gw = GatewayThread(server_name=server.name, admin_key="sesame")
    try:
        key = {"Authorization": "Bearer sesame"}
        shown = gw.get("/admin/adapters", headers=key).json()
        assert shown["tiny"] == ["a0", "a2"]
        answer = httpx_delete(f"{gw.url}/admin/adapters/tiny/a2", key)
        assert answer.status_code == 200 and answer.json()["adapters"] == ["a0"], answer.text
        again = httpx_post(f"{gw.url}/admin/adapters", key, {"model": "tiny", "name": "a2", "path": adapters["a2"]})
        assert again.status_code == 200 and sorted(again.json()["adapters"]) == ["a0", "a2"], again.text
        missing = httpx_delete(f"{gw.url}/admin/adapters/tiny/zz", key)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_adapter"
    finally:
        gw.stop()
    gone = mpserve("adapters", "unload", "tiny", "a2", *name)
    assert gone.returncode == 0 and "unloaded adapter 'a2' of model 'tiny'" in gone.stdout, gone.stderr


def httpx_post(url: str, headers: dict[str, str], body: dict[str, str]) -> object:
    import httpx

    return httpx.post(url, json=body, headers=headers, timeout=60)


def httpx_delete(url: str, headers: dict[str, str]) -> object:
    import httpx

    return httpx.delete(url, headers=headers, timeout=60)
