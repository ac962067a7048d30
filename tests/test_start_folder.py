"""A server started from a folder that holds packages named as its own (a clone's parent folder, a shared /tmp):
none of its processes imports them (``mpserve.children``), so the start serves and the planted code never runs.
And a model whose processes keep dying before they start is failed: a request for it ends ``model_failed``
instead of waiting for ever (before, the zygote was restarted every 30 s for ever and the request waited)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess
from helpers import free_port, http_up, wait_for

from mpserve import Client
from mpserve.errors import ModelFailed
from mpserve.runtime import ServerInfo

PLANTED = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"  # a package that has none of mpserve's modules

# The server's processes start with the planted packages first on their path: what a start from such a folder did
# before, and what PYTHONPATH still does now. (Not in the processes multiprocessing starts, which import this file.)
LAUNCHER = """
import os
import sys

from mpserve import children
from mpserve.cli import main

if __name__ == "__main__":
    os.environ["PYTHONPATH"] = sys.argv.pop(1)
    children.check_importable = lambda: None  # the start would refuse this at once; here its processes are to fail
    sys.argv[0] = "mpserve"
    main()
"""


def plant(folder: Path, marker: Path) -> Path:
    """``folder`` with packages ``mpserve`` and ``llama_cpp`` that write ``marker`` when imported."""
    folder.mkdir()
    for name in ("mpserve", "llama_cpp"):
        (folder / name).mkdir()
        (folder / name / "__init__.py").write_text(PLANTED.format(marker=str(marker)))
    return folder


@pytest.mark.timeout(120)
def test_a_start_from_a_folder_holding_a_planted_mpserve_serves_and_runs_none_of_it(
        start_server: type[ServerProcess], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "the-planted-code-ran"
    monkeypatch.chdir(plant(tmp_path / "shared", marker))
    port = free_port()
    script = Path(sys.executable).parent / "mpserve"  # as an operator starts it: the installed command
    server = start_server("--model", "builtin:tiny", "--instances", "2", "--http", f"127.0.0.1:{port}",
                          "--http-workers", "2", launch=(str(script),)).wait_ready()
    with Client(server.address, timeout=30) as client:
        assert client.generate("from a shared folder", max_tokens=4).usage.completion_tokens == 4
    wait_for(lambda: http_up(f"http://127.0.0.1:{port}"), 30, "the HTTP gateways up")
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                   json={"model": "tiny", "prompt": "over HTTP", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert not marker.exists(), "a process of the server imported the planted package"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["builtin:tiny", "echo"], ids=["zygote", "spawned"])
def test_a_model_whose_processes_keep_dying_as_they_start_is_failed_and_its_request_told(
        start_server: type[ServerProcess], tmp_path: Path, model: str) -> None:
    launcher = tmp_path / "launcher.py"
    launcher.write_text(LAUNCHER)
    planted = plant(tmp_path / "planted", tmp_path / "ran")
    server = start_server("--model", model, "--instances", "1", launch=(str(launcher), str(planted)))
    wait_for(lambda: ServerInfo.read(server.name) is not None, 30, "the server's sockets")
    with Client(server.address) as client, pytest.raises(ModelFailed, match="times in a row before"):
        client.generate("waits for an instance that never starts", max_tokens=4)  # no timeout of its own
    wait_for(lambda: any("not retrying" in line for line in server.log), 10,  # read from its pipe by a thread
             "the server's line that the model failed")
