"""``mpserve reload`` (and SIGHUP) under a steady load: a changed limit, an added model, a removed model and a
changed context size (a roll: ``tests/test_rolling.py``); no request fails, and what changed is said, one line
each; a configuration that does not validate is refused whole and changes nothing."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import ServerProcess
from helpers import free_port, http_up, mpserve, wait_for

from mpserve.client import Client
from mpserve.errors import MpserveError, UnknownModel
from mpserve.gateway.backend import TEMPLATE_TTL_S
from mpserve.models import templates

pytestmark = pytest.mark.timeout(180)


def _write(path: Path, **values: object) -> None:
    path.write_text(yaml.safe_dump(values))


def _steady(address: str, models: list[str], stop: threading.Event, failures: list[str], done: list[int]) -> None:
    """Requests one after another on each model in turn until ``stop``; any failure recorded."""
    with Client(address, timeout=60) as client:
        i = 0
        while not stop.is_set():
            model = models[i % len(models)]
            try:
                client.generate(f"request {i}", model=model, max_tokens=16)
                done[0] += 1
            except UnknownModel:
                if model not in ("old",):  # the removed model's refusals are what a reload promised
                    raise
                models.remove("old")
            except MpserveError as exc:
                failures.append(f"{model}: {exc.code}: {exc.message}")
            i += 1


def test_a_reload_under_load_applies_what_it_can_and_names_the_rest(start_server, tmp_path: Path) -> None:
    config = tmp_path / "pool.yaml"
    models = [{"name": "keep", "path": "echo", "n_ctx": 2048, "parallel": 2, "echo_tick_ms": 2},
              {"name": "old", "path": "echo", "parallel": 2, "echo_tick_ms": 2}]
    _write(config, max_queue=64, models=models)
    server: ServerProcess = start_server("--config", str(config), "--spare-slots", "2").wait_ready()
    stop, failures, done = threading.Event(), [], [0]
    threads = [threading.Thread(target=_steady, args=(server.address, ["keep", "old"], stop, failures, done))
               for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: done[0] > 20, 30, "the load to run")
        _write(config, max_queue=32, models=[{**models[0], "n_ctx": 4096},
                                             {"name": "new", "path": "echo", "parallel": 2, "echo_tick_ms": 2}])
        answer = mpserve("reload", "--server-name", server.name)
        assert answer.returncode == 0, answer.stderr
        lines = answer.stdout.splitlines()
        assert "max_queue: 64 -> 32" in lines
        assert "models[new]: added (echo, instances 1)" in lines
        assert any(line.startswith("models[old]: removed") for line in lines)
        assert "models[keep]: n_ctx 2048 -> 4096: rolling (its instances replaced one at a time)" in lines
        with Client(server.address, timeout=60) as client:
            assert client.generate("hello", model="new", max_tokens=4).text
            with pytest.raises(UnknownModel, match="removed from the configuration"):
                client.generate("hello", model="old", max_tokens=4)
        before = done[0]
        wait_for(lambda: done[0] > before + 20, 30, "the load to go on")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert failures == []
    status = mpserve("models", "--server-name", server.name)
    assert "new" in status.stdout
    wait_for(lambda: "model keep: echo, n_ctx 4096, parallel 2" in (status := mpserve(
        "status", "--server-name", server.name).stdout) and "rolling" not in status, 30, "the roll to end")
    assert any("roll of keep done" in line for line in server.log)

    _write(config, max_queue="many", models=models)  # does not validate: refused whole
    refused = mpserve("reload", "--server-name", server.name)
    assert refused.returncode == 1 and "max_queue" in refused.stderr
    with Client(server.address, timeout=60) as client:
        assert client.generate("hello", model="new", max_tokens=4).text  # what ran stays

    _write(config, max_queue=32, models=[{**models[0], "n_ctx": 4096}, {**models[1], "n_ctx": 1024},
                                         {"name": "new", "path": "echo", "parallel": 2, "echo_tick_ms": 2}])
    server.proc.send_signal(signal.SIGHUP)  # the same, by signal: "old" is served again, with another n_ctx
    wait_for(lambda: any("reload (SIGHUP): models[old]: added" in line for line in server.log), 30,
             "the SIGHUP reload")
    with Client(server.address, timeout=60) as client:
        assert client.generate("hello", model="old", max_tokens=4).text
    assert "model old: echo, n_ctx 1024, parallel 2" in mpserve("status", "--server-name", server.name).stdout


def test_a_reload_applies_a_tenants_section_at_once(start_server, tmp_path: Path) -> None:
    config = tmp_path / "pool.yaml"
    models = [{"name": "echo", "path": "echo", "parallel": 2, "echo_tick_ms": 5}]
    _write(config, models=models)
    server: ServerProcess = start_server("--config", str(config)).wait_ready()
    with Client(server.address, timeout=60) as client:
        assert client.generate("hello", max_tokens=4).text  # no limit yet
        _write(config, models=models, tenants={"local": {"max_running": 1, "max_queued": 0}})
        answer = mpserve("reload", "--server-name", server.name)
        assert answer.returncode == 0, answer.stderr
        assert "tenants: none -> 1 tenant(s) declared" in answer.stdout.splitlines()
        chunks = iter(client.stream("hold the slot", max_tokens=2000))
        next(chunks)  # running: the tenant's one
        with pytest.raises(MpserveError, match="max_queued") as refused:
            client.generate("one too many", max_tokens=4)
        assert refused.value.code == "busy"
        assert "".join(chunks)  # the running one ends whole


def test_a_reload_reads_the_gateways_api_key_file_again(start_server, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("key-a\n")
    keys.chmod(0o600)  # a key file others may read is refused
    port = free_port()
    server: ServerProcess = start_server("--model", "echo", "--http", f"127.0.0.1:{port}", "--http-workers", "2",
                                         "--api-key-file", str(keys)).wait_ready()

    def status(key: str) -> int:
        return httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"authorization": f"Bearer {key}"},
                         timeout=10).status_code

    wait_for(lambda: status("key-a") == 200, 60, "the gateway to take key-a")
    assert status("key-b") == 401
    keys.write_text("# key-a is revoked\nkey-b\n")
    assert mpserve("reload", "--server-name", server.name).returncode == 0
    for _ in range(8):  # new connections: either gateway process may answer
        wait_for(lambda: status("key-b") == 200 and status("key-a") == 401, 30, "every gateway to read the file")


def test_a_model_added_by_mpserve_add_and_then_written_in_the_file_reloads(start_server, tmp_path: Path) -> None:
    config = tmp_path / "pool.yaml"
    models = [{"name": "keep", "path": "echo"}]
    _write(config, models=models)
    server: ServerProcess = start_server("--config", str(config), "--spare-slots", "2").wait_ready()
    added = mpserve("add", "echo", "--name", "extra", "--server-name", server.name)
    assert added.returncode == 0, added.stderr
    _write(config, models=[*models, {"name": "extra", "path": "echo", "instances": 1}])
    answer = mpserve("reload", "--server-name", server.name)
    assert answer.returncode == 0, answer.stderr  # it was refused: "served already"
    assert "models[extra]: added" not in answer.stdout


@pytest.mark.timeout(120)
def test_a_reload_that_changes_the_chat_template_puts_the_new_one_in_force(start_server, tiny_model_path: str,
                                                                          tmp_path: Path) -> None:
    """The broker hands out the reload's template (STATS), a family's or ChatML's (""), not the one the instances it
    replaced loaded, and no instance's was logged as kept; the gateways ``start --http`` runs render chats with it
    from the reload on (a chat's prompt tokens are another count under each template), well before they would ask
    the broker again (TEMPLATE_TTL_S)."""
    config = tmp_path / "pool.yaml"
    model = {"name": "tiny", "path": tiny_model_path, "parallel": 2, "chat_template": "llama3"}
    _write(config, spare_slots=4, models=[model])
    port = free_port()
    server: ServerProcess = start_server("--config", str(config), "--http", f"127.0.0.1:{port}").wait_ready()

    def prompt_tokens() -> int:
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 200, answer.text
        count: int = answer.json()["usage"]["prompt_tokens"]
        return count

    wait_for(lambda: http_up(f"http://127.0.0.1:{port}"), 30, "the gateway")
    counts = [prompt_tokens()]
    with Client(server.address, timeout=60) as client:
        assert client.stats().models["tiny"].chat_template == templates.FAMILIES["llama3"]
        for rolls, family in enumerate(("gemma", "chatml"), 1):  # chatml: "", the gateway's ChatML default
            _write(config, spare_slots=4, models=[{**model, "chat_template": family}])
            answer = mpserve("reload", "--server-name", server.name)
            assert answer.returncode == 0, answer.stderr
            wait_for(lambda: prompt_tokens() != counts[-1], TEMPLATE_TTL_S / 2, f"the gateway to render {family}")
            counts.append(prompt_tokens())
            wait_for(lambda n=rolls: "rolling" not in mpserve("status", "--server-name", server.name).stdout
                     and sum("roll of tiny done" in line for line in server.log) == n, 60, "the roll to end")
            assert client.stats().models["tiny"].chat_template == templates.FAMILIES[family], family
    assert len(set(counts)) == 3, counts
    assert not any("kept that one" in line for line in server.log), "\n".join(server.log)
