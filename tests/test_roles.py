"""Roles on the ZeroMQ side: a client may generate, only an operator may administer (CONTROL, SLOT_ACTION),
on ipc (the admin socket, this user alone) and over CURVE (admin keys on a tcp admin socket); and
``mpserve start`` with a CURVE --bind and --http, whose gateway reaches its broker with a key of its own.
"""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess
from helpers import free_port, http_up, mpserve, wait_for

from mpserve import Client
from mpserve.errors import ConnectionFailed, Forbidden
from mpserve.runtime import runtime_dir


@pytest.mark.timeout(120)
def test_on_ipc_only_the_admin_socket_takes_control_and_slot_actions(start_server: type[ServerProcess]) -> None:
    server = start_server("--instances", "1").wait_ready()
    admin_file = Path(server.admin.removeprefix("ipc://"))
    assert server.admin != server.address and stat.S_IMODE(admin_file.stat().st_mode) == 0o600
    with Client(server.address, timeout=60) as client:
        assert client.generate("hello", max_tokens=4).usage.completion_tokens == 4
        with pytest.raises(Forbidden, match="CONTROL is an operator's call"):
            client.control("unload", "tiny")
        with pytest.raises(Forbidden, match="SLOT_ACTION is an operator's call"):
            client.slot("erase", "w0", 0)
        assert client.stats().counters["rejected_forbidden"] == 2
        assert client.stats().models["tiny"].instances == 1  # nothing was unloaded
    with Client(server.admin, timeout=60) as admin:
        assert admin.generate("hello", max_tokens=4).usage.completion_tokens == 4  # an operator may generate
        assert admin.slot("erase", "w0", 0).action == "erase"
        assert [m.name for m in admin.control("models").models] == ["tiny"]
    listed = mpserve("models", "--server-name", server.name, "--json")
    assert listed.returncode == 0 and '"tiny"' in listed.stdout, listed.stderr
    assert server.tracebacks() == []


def keygen(directory: Path, name: str) -> tuple[str, str]:
    done = mpserve("keygen", str(directory), name)
    assert done.returncode == 0, done.stderr
    return str(directory / f"{name}.key"), str(directory / f"{name}.key_secret")


@pytest.mark.timeout(180)
def test_over_curve_client_keys_generate_admin_keys_administer_and_start_http_reaches_its_broker(
        start_server: type[ServerProcess], tmp_path: Path) -> None:
    keys, clients, admins = tmp_path / "keys", tmp_path / "clients", tmp_path / "admins"
    server_public, server_secret = keygen(keys, "server")
    client_public, client_secret = keygen(keys, "client")
    admin_public, admin_secret = keygen(keys, "admin")
    for folder, public in ((clients, client_public), (admins, admin_public)):
        folder.mkdir()
        shutil.copy(public, folder)
    front, admin_port, http_port = free_port(), free_port(), free_port()
    server = start_server("--instances", "1", "--bind", f"tcp://127.0.0.1:{front}", "--admin-bind",
                          f"tcp://127.0.0.1:{admin_port}", "--curve-secret", server_secret, "--curve-clients",
                          str(clients), "--curve-admins", str(admins), "--http", f"127.0.0.1:{http_port}",
                          "--admin-key", "ops").wait_ready()
    as_client = {"curve_server_key": server_public, "curve_secret": client_secret}
    as_admin = {"curve_server_key": server_public, "curve_secret": admin_secret}
    with Client(f"tcp://127.0.0.1:{front}", timeout=60, **as_client) as client:
        assert client.generate("hello", max_tokens=4).usage.completion_tokens == 4
        with pytest.raises(Forbidden):
            client.control("unload", "tiny")
        with pytest.raises(Forbidden):
            client.slot("erase", "w0", 0)
    with pytest.raises(ConnectionFailed):  # a client key does not open the admin socket
        Client(f"tcp://127.0.0.1:{admin_port}", connect_timeout=2.0, **as_client).close()
    with Client(f"tcp://127.0.0.1:{admin_port}", timeout=60, **as_admin) as admin:
        assert admin.slot("erase", "w0", 0).action == "erase"
        assert admin.control("models").models[0].instances == 1

    url = f"http://127.0.0.1:{http_port}"  # the gateway start runs: its own key for the front and the admin socket
    wait_for(lambda: http_up(url), 30, "the gateway's /health answering 200")
    done = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4, done.text
    listed = httpx.get(url + "/admin/models", headers={"Authorization": "Bearer ops"}, timeout=30)
    assert listed.status_code == 200 and listed.json()["models"][0]["name"] == "tiny", listed.text
    assert server.stop() == 0
    assert not list(runtime_dir().glob(f"{server.name}.gateway.key*"))  # its key went with the server
    assert server.tracebacks() == []
