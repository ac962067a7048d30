"""Instances that follow the load, on real servers: a burst scales up to max and idleness back to min;
draining lets running streams finish; a scale-up that does not fit is skipped, never an error; min 0 loads
on demand; the control API changes bounds at run time and refuses bad calls without changing anything."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
from helpers import LOADED, config_file, load, mpserve, wait_for

from mpserve.client import AsyncClient, Client, Result
from mpserve.errors import BadRequest, ConfigError, ModelDoesNotFit, UnknownModel
from mpserve.wire import protocol as wire

pytestmark = pytest.mark.timeout(120)

QUICK = ["--scale-up-after", "0.3", "--scale-down-after", "1"]


def scaling(client: Client, model: str = "tiny") -> wire.ModelScaling:
    return client.stats().models[model].scaling


def models(client: Client) -> dict[str, wire.ModelControl]:
    return {m.name: m for m in client.control("models").models}


def test_a_burst_scales_up_to_max_and_idleness_back_to_min(start_server) -> None:
    server = start_server("--min-instances", "1", "--max-instances", "3", *QUICK).wait_ready()
    most = 0

    async def burst() -> list[Result]:
        nonlocal most
        async with AsyncClient(server.address, timeout=100) as client:
            tasks = [asyncio.create_task(client.generate(f"burst {i}", max_tokens=400, temperature=0))
                     for i in range(40)]
            while not all(t.done() for t in tasks):
                most = max(most, (await client.stats()).models["tiny"].instances)
                await asyncio.sleep(0.05)
            return [t.result() for t in tasks]

    results = asyncio.run(burst())
    assert len(results) == 40 and most == 3
    assert len({r.worker for r in results}) == 3  # the new instances took requests
    with Client(server.admin) as client:
        wait_for(lambda: client.stats().models["tiny"].instances == 1, 30, "back to one instance")
        events = scaling(client).events
        assert events["start_queue"] == 2 and events["stop_idle"] == 2 and "skip_at_max" in events
        assert models(client)["tiny"] == wire.ModelControl("tiny", "builtin:tiny", 1, 0, 0, 1, 3, 3, "ready")
    assert any("scale up tiny (queue): starting worker 1" in line for line in server.log)
    # the log is read by a thread: the second line may come a moment after the count dropped
    wait_for(lambda: sum("scaled down" in line for line in server.log) >= 2, 10, "both scale-downs in the log")
    assert sum("scaled down" in line for line in server.log) == 2
    assert server.tracebacks() == []


def test_draining_lets_running_streams_finish_with_their_full_text(start_server) -> None:
    server = start_server("--instances", "2", "--max-instances", "2", "--parallel", "2").wait_ready()

    async def run() -> tuple[list[tuple[str, Result]], list[Result]]:
        async with AsyncClient(server.admin, timeout=100) as client:
            async def streamed(i: int) -> tuple[str, Result]:
                stream = client.stream(f"drain {i}", max_tokens=600, temperature=0)
                text = "".join([piece async for piece in stream])
                assert stream.result is not None
                return text, stream.result

            tasks = [asyncio.create_task(streamed(i)) for i in range(4)]
            while (await client.stats()).models["tiny"].running < 4:
                await asyncio.sleep(0.01)
            await client.control("scale", "tiny", min=1, max=1)  # one of the two drains now
            done = await asyncio.gather(*tasks)
            again = [await client.generate(f"drain {i}", max_tokens=600, temperature=0) for i in range(4)]
            return done, again

    done, again = asyncio.run(run())
    drain = re.compile(r"scale down tiny \(max\): draining worker (w\d)")
    drained = next(m[1] for line in server.log if (m := drain.search(line)))
    assert sum(r.worker == drained for _, r in done) == 2  # two streams ran on the instance that drained
    for (text, result), reference in zip(done, again, strict=True):
        assert text == result.text == reference.text and result.usage.completion_tokens == 600
    with Client(server.address) as client:
        wait_for(lambda: scaling(client).draining == 0 and client.stats().models["tiny"].instances == 1, 30,
                 "the drained instance gone")
        assert scaling(client).events == {"stop_max": 1}
    assert server.tracebacks() == []


def test_a_scale_up_that_does_not_fit_is_skipped_with_a_log_line_and_a_metric(start_server,
                                                                             tiny_model_path: str) -> None:
    server = start_server("--min-instances", "1", "--max-instances", "2", *QUICK, "--simulate-gpus", "1x24GiB",
                          "--gpu-memory-budget", "800MiB", "--spare-slots", "1").wait_ready()

    async def burst() -> list[Result]:
        async with AsyncClient(server.address, timeout=100) as client:
            return await asyncio.gather(*[client.generate(f"fit {i}", max_tokens=400, temperature=0)
                                          for i in range(16)])  # seconds of queueing, far over scale_up_after

    assert len(asyncio.run(burst())) == 16  # every request served, by the one instance that fits
    with Client(server.admin) as client:
        assert scaling(client).events == {"skip_does_not_fit": 1}
        assert client.stats().models["tiny"].instances == 1
        with pytest.raises(ModelDoesNotFit, match="800.0 MiB budget"):
            client.control("scale", "tiny", min=2)
        with pytest.raises(ModelDoesNotFit, match="model 'more' instance 0 needs 513.4 MiB"):
            client.control("add", "more", path=tiny_model_path)
        assert models(client)["tiny"].min == 1 and list(models(client)) == ["tiny"]  # refused: nothing changed
    skipped = [line for line in server.log if "scale-up of tiny skipped (does_not_fit)" in line]
    assert len(skipped) == 1 and "needs 513.4 MiB" in skipped[0]


def test_min_zero_scales_to_zero_and_the_next_request_waits_for_a_load(start_server) -> None:
    server = start_server("--min-instances", "0", "--max-instances", "1", "--scale-down-after", "0.5").wait_ready()
    assert any("no instance runs until a request asks for one" in line for line in server.log)
    with Client(server.address, timeout=60) as client, Client(server.admin) as admin:
        assert client.stats().models["tiny"].instances == 0
        assert client.generate("first", max_tokens=8).usage.completion_tokens == 8
        wait_for(lambda: client.stats().models["tiny"].instances == 0 and scaling(client).draining == 0, 30,
                 "scaled to zero")
        assert models(admin)["tiny"].state == "scaled to zero"
        assert client.generate("again", max_tokens=8).usage.completion_tokens == 8
        assert scaling(client).events["start_demand"] == 2


def test_the_control_api_changes_one_model_while_another_serves_undisturbed(start_server, tmp_path: Path,
                                                                           tiny_model_path: str) -> None:
    config = tmp_path / "two.yaml"
    config.write_text("models:\n  - {name: echo, path: echo}\n"
                      "  - {name: tiny, path: builtin:tiny, instances: {min: 0, max: 2}, scale_down_after: 60}\n")
    server = start_server("--config", str(config), "--spare-slots", "2").wait_ready()
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("not a model")
    stop = threading.Event()
    served: list[str] = []

    def other() -> None:
        with Client(server.address, timeout=30) as client:
            while not stop.is_set():
                served.append(client.generate("undisturbed", model="echo").text)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        with Client(server.admin, timeout=60) as client:
            before = models(client)
            for bad, error, message in [
                (dict(op="load", model="nope"), UnknownModel, "served models: echo, tiny"),
                (dict(op="scale", model="tiny", min=3), BadRequest, "min 3 is above max 2"),
                (dict(op="scale", model="tiny", max=5), BadRequest, "max 5 is above 2, the most instances"),
                (dict(op="scale", model="tiny", min=2, max=1), BadRequest, r"'min' \(2\) is above 'max' \(1\)"),
                (dict(op="add", path=str(not_gguf)), ConfigError, "notes.gguf' is not a GGUF model file"),
                (dict(op="add", path=str(tmp_path / "none.gguf")), ConfigError, "no such model file"),
                (dict(op="add", model="echo", path=tiny_model_path), BadRequest, "'echo' is served already"),
                (dict(op="add", model="big", path=tiny_model_path, max=3), ConfigError,
                 r"needs 3 slot-table row\(s\) .* and 2 are left; start the server with a larger --spare-slots"),
            ]:
                with pytest.raises(error, match=message):
                    client.control(bad.pop("op"), **bad)  # type: ignore[arg-type]
            assert models(client) == before
            client.control("load", "tiny")
            wait_for(lambda: models(client)["tiny"].instances == 1, 30, "tiny loaded")
            client.control("scale", "tiny", min=2)
            wait_for(lambda: models(client)["tiny"].instances == 2, 30, "tiny at two")
            client.control("unload", "tiny")
            wait_for(lambda: models(client)["tiny"].instances == 0 and models(client)["tiny"].draining == 0, 30,
                     "tiny unloaded")
            assert models(client)["tiny"].min == 0 and scaling(client).events == {
                "start_min": 2, "stop_unload": 2}
            assert scaling(client, "echo") == wire.ModelScaling(
                    1, 1, 1, settings="echo, n_ctx 2048, parallel 1, KV f16/f16")
            added = client.control("add", "t2", path=tiny_model_path, max=2)
            assert added.message == "add t2: instances 1..2" and list(models(client)) == ["echo", "tiny", "t2"]
            assert client.generate("added", model="t2", max_tokens=4).usage.completion_tokens == 4
            assert models(client)["t2"] == wire.ModelControl("t2", tiny_model_path, 1, 0, 0, 1, 2, 2, "ready")
    finally:
        stop.set()
        thread.join(30)
    assert served and set(served) == {"undisturbed"}


def test_the_cli_lists_and_scales_models(start_server) -> None:
    server = start_server("--min-instances", "1", "--max-instances", "2").wait_ready()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return mpserve(*args, "--server-name", server.name, timeout=30)

    listed = cli("models")
    assert listed.returncode == 0 and listed.stdout.split("\n")[1].split() == [
        "tiny", "ready", "1", "0", "0", "1", "2", "2", "builtin:tiny"]
    scaled = cli("scale", "tiny", "--max", "1", "--json")
    assert scaled.returncode == 0 and json.loads(scaled.stdout)["models"][0]["max"] == 1
    refused = cli("scale", "tiny", "--min", "2")
    assert refused.returncode == 1 and "error: [bad_request] min 2 is above max 1" in refused.stderr
    missing = cli("add", "nowhere.gguf")  # the path is sent absolute: the server has another folder
    assert missing.returncode == 1 and f"no such model file '{Path.cwd() / 'nowhere.gguf'}'" in missing.stderr
    status = cli("status")
    assert "scaling tiny: 1..1 instances, 0 starting, 0 draining; events: none" in status.stdout


@pytest.mark.timeout(180)
def test_single_active_backend_and_exclusive_permits_hold_while_instances_come_and_go(start_server,
                                                                                        tmp_path: Path) -> None:
    from mpserve.gpu.permits import max_concurrent, read_holds

    holds = tmp_path / "holds.log"
    config = config_file(tmp_path, "sab", switch_batch=3, permit_log=str(holds), models=[
        {"name": "a", "path": "builtin:tiny", "instances": {"min": 1, "max": 2}, "scale_up_after": 0.2,
         "scale_down_after": 1},
        {"name": "b", "path": "builtin:tiny", "instances": {"min": 0, "max": 2}, "scale_up_after": 0.2,
         "scale_down_after": 1}])
    server = start_server("--config", config, "--simulate-gpus", "1x24GiB", "--single-active-backend",
                          "--gpu-mode", "exclusive").wait_ready()
    residents: list[set[str]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            residents.append({r.model for r in server.slots() if r.state in LOADED})
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        outcomes = asyncio.run(load(server.address, 40, 200, 8, models=["a", "b"]))
        with Client(server.address) as client:
            wait_for(lambda: sum(m.instances for m in client.stats().models.values()) == 1, 30, "back to min")
            events = {name: m.scaling.events for name, m in client.stats().models.items()}
    finally:
        stop.set()
        watcher.join()
    assert all(isinstance(o, Result) for o in outcomes), outcomes
    assert events["b"]["start_demand"] >= 1 and sum(e.get("start_queue", 0) for e in events.values()) >= 1
    assert max(len(models) for models in residents) == 1  # at most one model resident on the GPU, all along
    assert max_concurrent(read_holds(holds)) == 1  # never two requests computing on the GPU at once
    assert server.tracebacks() == []


def test_the_http_control_api_takes_the_admin_key_only(start_server) -> None:
    import httpx
    from gateway_thread import GatewayThread

    from mpserve.gateway.app import GatewayConfig, create_app

    server = start_server("--min-instances", "1", "--max-instances", "2").wait_ready()
    gateway = GatewayThread(server_name=server.name, api_key="infer", admin_key="admin")
    off = GatewayThread(server_name=server.name)
    admin, infer = {"Authorization": "Bearer admin"}, {"Authorization": "Bearer infer"}

    def post(path: str, body: object = None) -> httpx.Response:
        return httpx.post(f"{gateway.url}/admin/models/{path}".rstrip("/"), json=body, headers=admin, timeout=30)

    def instances() -> int:
        return int(gateway.get("/admin/models", headers=admin).json()["models"][0]["instances"])

    try:
        assert gateway.get("/admin/models", headers=infer).json()["error"]["code"] == "invalid_admin_key"
        assert gateway.get("/v1/models", headers=admin).status_code == 401  # the admin key is not for inference
        assert off.get("/admin/models").status_code == 404
        listed = gateway.get("/admin/models", headers=admin)
        assert listed.status_code == 200 and listed.json()["models"][0] == {
            "name": "tiny", "path": "builtin:tiny", "instances": 1, "starting": 0, "draining": 0, "min": 1,
            "max": 2, "ceiling": 2, "state": "ready"}
        for path, body, status, code in [("tiny/scale", {"min": 3}, 400, "bad_request"),
                                         ("tiny/scale", {"min": "two"}, 400, "bad_request"),
                                         ("tiny/scale", {"least": 1}, 400, "bad_request"),
                                         ("nope/load", None, 404, "unknown_model"),
                                         ("tiny/grow", None, 404, "not_found"),
                                         ("", {"path": 3}, 400, "bad_request"),
                                         ("", {"path": "/no/such.gguf"}, 500, "config")]:
            refused = post(path, body)
            assert (refused.status_code, refused.json()["error"]["code"]) == (status, code), refused.text
        assert instances() == 1
        assert post("tiny/scale", {"min": 2}).json()["message"] == "scale tiny: instances 2..2"
        wait_for(lambda: instances() == 2, 30, "two instances")
        metrics = off.metrics()
        assert metrics[("mpserve_scale_starts_total", (("model", "tiny"), ("reason", "min")))] == 1
        assert metrics[("mpserve_instances_min", (("model", "tiny"),))] == 2
    finally:
        gateway.stop()
        off.stop()
    with pytest.raises(ConfigError, match="must differ"):
        create_app(GatewayConfig(api_key="same", admin_key="same"))
