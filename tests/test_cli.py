"""The README's path: `mpserve start --instances 4`, then `mpserve generate` and `mpserve status` from
another shell."""

from __future__ import annotations

import json

import pytest
from helpers import mpserve


@pytest.mark.timeout(120)
def test_start_four_instances_then_generate_and_status_from_other_processes(start_server) -> None:
    server = start_server("--instances", "4").wait_ready()
    name = ["--server-name", server.name]

    out = mpserve("generate", "Hello", "--max-tokens", "12", "--temperature", "0", "--json", *name)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["usage"]["completion_tokens"] == 12 and result["finish_reason"] == "length"

    streamed = mpserve("generate", "Hello", "--max-tokens", "12", "--temperature", "0", "--stream", *name)
    assert streamed.returncode == 0 and streamed.stdout.strip() == result["text"].strip()

    status = mpserve("status", "--json", *name)
    assert status.returncode == 0, status.stderr
    rows = json.loads(status.stdout)["slots"]
    assert len(rows) == 4
    assert all(r["state"] == "idle" and r["model"] == "tiny" and r["device"] == -1 for r in rows)
    assert sum(r["served"] for r in rows) == 2
    assert len({r["pid"] for r in rows}) == 4
    assert all(r["kv_capacity"] == 2048 for r in rows)  # n_ctx: the cells a slot may hold
    assert all(r["cache"]["capacity"] == 256 << 20 for r in rows)  # each instance's prompt cache, on by default
    used = [r for r in rows if r["served"]]  # each request's prompt and 11 generated tokens stay in its slot
    assert all(r["kv_cells"] >= 12 for r in used) and all(r["kv_cells"] == 0 for r in rows if not r["served"])

    table = mpserve("status", *name)
    assert table.returncode == 0 and table.stdout.count(" idle ") == 4, table.stdout
    used_by_worker = {r["worker"]: r["kv_cells"] for r in rows}
    for worker, cells in used_by_worker.items():  # one slot per instance: the instance holds its slot's cells
        assert f"instance w{worker} (tiny): KV cells {cells} of 2048" in table.stdout


@pytest.mark.timeout(60)
def test_generate_and_status_without_a_server_say_how_to_start_one() -> None:
    for args in (["generate", "hi"], ["status"]):
        out = mpserve(*args, "--server-name", "nobody-here")
        assert out.returncode == 1
        assert "mpserve start" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.timeout(60)
def test_unknown_model_on_the_command_line_is_a_clear_error(tiny_server) -> None:
    out = mpserve("generate", "hi", "--model", "gpt-9", "--server-name", tiny_server.name)
    assert out.returncode == 1 and "unknown_model" in out.stderr and "tiny" in out.stderr


@pytest.mark.timeout(60)
def test_generate_for_a_server_not_running_names_those_that_run_as_status_does(tiny_server) -> None:
    for args in (["generate", "hi"], ["status"]):
        out = mpserve(*args, "--server-name", f"{tiny_server.name}-not")
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert "running here: " in out.stderr and tiny_server.name in out.stderr, (args, out.stderr)


@pytest.mark.timeout(30)
def test_make_model_writes_the_same_bytes_twice(tmp_path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    assert mpserve("make-model", str(a)).returncode == 0
    assert mpserve("make-model", str(b), "--size", "tiny").returncode == 0
    assert a.read_bytes() == b.read_bytes()
    bad = mpserve("make-model", str(a), "--size", "huge")
    assert bad.returncode == 1 and "allowed sizes" in bad.stderr




@pytest.mark.timeout(30)
def test_version_prints_the_package_version() -> None:
    from mpserve import __version__

    out = mpserve("--version")
    assert out.returncode == 0 and out.stdout == f"mpserve {__version__}\n"


@pytest.mark.timeout(60)
def test_devices_help_names_the_nvml_extra_and_devices_reads_a_servers_config(tmp_path) -> None:
    helped = mpserve("devices", "--help", env={"COLUMNS": "300"})
    assert "(mpserve[nvml])" in helped.stdout  # not eaten as Rich markup
    config = tmp_path / "c.yaml"
    config.write_text("simulate_gpus: 2x24GiB\nmodels:\n  - path: echo\n")
    shown = mpserve("devices", "--config", str(config), env={"MPSERVE_SIMULATE_GPUS": ""})
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.count("(simulated)  24.0 GiB free of 24.0 GiB") == 2, shown.stdout
