"""LoRA adapters at the front: declared with --lora, listed by /v1/models as MODEL:NAME, chosen by the model field,
llama-server's lora list (ids in declaration order, or names) or the clients' adapters argument; an unknown adapter
is a 404 naming those served, an unknown id or a scale out of range a 400, and a bad adapter file ends the start in
one line."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess
from helpers import mpserve, write_adapter

from mpserve import Client
from mpserve.errors import BadRequest, UnknownAdapter


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("adapters")
    return {name: write_adapter(folder / f"{name}.gguf") for name in ("fr", "de")}


@pytest.fixture(scope="module")
def server(adapters: dict[str, Path]) -> Iterator[ServerProcess]:
    flags = [arg for name, path in adapters.items() for arg in ("--lora", f"{name}={path}")]
    server = ServerProcess("--model", "builtin:tiny", *flags).wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway(server: ServerProcess) -> Iterator[object]:
    from gateway_thread import GatewayThread

    gw = GatewayThread(server_name=server.name)
    yield gw
    gw.stop()


def post(gateway: object, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{gateway.url}{path}", json=body, timeout=30)  # type: ignore[attr-defined]


def test_models_lists_each_adapter_with_its_parent(gateway: object) -> None:
    data = gateway.get("/v1/models").json()["data"]  # type: ignore[attr-defined]
    assert [(m["id"], m.get("parent")) for m in data] == [("tiny", None), ("tiny:fr", "tiny"), ("tiny:de", "tiny")]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_each_api_takes_the_model_field_and_the_lora_list(gateway: object, path: str) -> None:
    body: dict[str, object] = {"prompt": "hello"} if path == "/v1/completions" else \
        {"input": "hello"} if path == "/v1/responses" else {"messages": [{"role": "user", "content": "hello"}]}
    budget = {"/v1/responses": "max_output_tokens"}.get(path, "max_tokens")
    for choice in ({"model": "tiny:fr"}, {"model": "tiny", "lora": [{"id": 1, "scale": 0.5}]},
                   {"model": "tiny", "lora": [{"name": "fr"}, {"id": 1, "scale": -1}]}):
        answer = post(gateway, path, {**body, **choice, budget: 4})
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == choice["model"]
    unknown = post(gateway, path, {**body, "model": "tiny:es", budget: 4})
    assert unknown.status_code == 404, unknown.text
    assert "no LoRA adapter 'es'" in unknown.text and "tiny:fr (id 0), tiny:de (id 1)" in unknown.text
    no_id = post(gateway, path, {**body, "model": "tiny", "lora": [{"id": 2}], budget: 4})
    assert no_id.status_code == 400 and "no LoRA adapter with id 2" in no_id.text
    too_strong = post(gateway, path, {**body, "model": "tiny", "lora": [{"id": 0, "scale": 9}], budget: 4})
    assert too_strong.status_code == 400 and "scale 9.0 is out of range; give a number from -4 to 4" in too_strong.text


def test_the_unknown_adapter_code_is_stable(gateway: object) -> None:
    answer = post(gateway, "/v1/completions", {"model": "tiny:es", "prompt": "x", "max_tokens": 1})
    assert answer.json()["error"]["code"] == "unknown_adapter"


def test_the_python_client_chooses_adapters_by_name_or_model(server: ServerProcess) -> None:
    with Client(server.address) as client:
        assert client.generate("hi", model="tiny:fr", max_tokens=3).text
        assert client.generate("hi", adapters={"fr": 0.5, "de": 1.0}, max_tokens=3).text
        with pytest.raises(UnknownAdapter, match="served adapters: tiny:fr"):
            client.generate("hi", adapters=["es"], max_tokens=3)
        with pytest.raises(BadRequest, match="out of range"):
            client.generate("hi", adapters={"fr": 5.0}, max_tokens=3)
        with pytest.raises(BadRequest, match="given twice"):
            client.generate("hi", model="tiny:fr", adapters=["fr"], max_tokens=3)


def test_a_model_without_adapters_says_how_to_declare_one(start_server: type[ServerProcess]) -> None:
    server = start_server("--model", "builtin:tiny").wait_ready()
    with Client(server.address) as client, pytest.raises(UnknownAdapter, match="declare them in its models"):
        client.generate("hi", model="tiny:fr", max_tokens=3)


@pytest.mark.parametrize("case", ["model file", "architecture", "missing file"])
def test_a_bad_adapter_ends_start_with_one_line(case: str, tmp_path: Path) -> None:
    from mpserve.models.builtin import builtin_model_path

    path = {"model file": str(builtin_model_path("tiny")), "architecture": str(write_adapter(
        tmp_path / "g.gguf", arch="gemma3")), "missing file": str(tmp_path / "none.gguf")}[case]
    done = mpserve("start", "--server-name", f"bad-lora-{case[:4]}", "--model", "builtin:tiny", "--lora", f"x={path}",
                   timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: [config] ") and path in lines[0] and "give " in lines[0]


@pytest.mark.timeout(120)
def test_the_node_client_chooses_adapters(server: ServerProcess) -> None:
    from test_node_client import run_script

    seen = run_script("adapters.mjs", server.address)
    with Client(server.address) as python:
        expected = python.generate("hello", model="tiny", adapters=["fr"], max_tokens=8, temperature=0).text
    assert seen["named"] == seen["chosen"] == expected
    assert seen["unknown"]["code"] == "unknown_adapter" and seen["unknown"]["isUnknownAdapter"]
    assert "served adapters: tiny:fr (id 0), tiny:de (id 1)" in seen["unknown"]["message"]


def test_metrics_count_requests_and_tokens_per_adapter(gateway: object) -> None:
    def counted() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {k: v for k, v in gateway.metrics().items() if k[0].startswith("mpserve_adapter_")}  # type: ignore

    before = counted()
    for body in ({"model": "tiny:fr"}, {"model": "tiny", "lora": [{"name": "fr"}, {"id": 1, "scale": 0.5}]},
                 {"model": "tiny"}):
        assert post(gateway, "/v1/completions", {**body, "prompt": "hello", "max_tokens": 3}).status_code == 200
    after = counted()

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"model": "tiny", **labels}.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("mpserve_adapter_requests_total", adapter="fr") == 2
    assert grew("mpserve_adapter_requests_total", adapter="de") == 1
    assert grew("mpserve_adapter_tokens_total", adapter="fr", kind="generated") == 6
    assert grew("mpserve_adapter_tokens_total", adapter="de", kind="generated") == 3
