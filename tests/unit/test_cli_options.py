"""Options declared once: the gateway's flags are its settings' (``mpserve.config.settings``), at their declared
defaults the gateway's own defaults, their ranges checked before anything starts; the operator commands take the
same server and CURVE options, from one bundle; what they print is ``mpserve.status_text``'s."""

from __future__ import annotations

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from mpserve.cli import app
from mpserve.gateway.app import GatewayConfig
from mpserve.gateway.run import configure
from mpserve.runtime import ServerInfo
from mpserve.status_text import format_devices, status_json

pytestmark = pytest.mark.timeout(30)

OPERATOR_COMMANDS = ["status", "generate", "models", "load", "unload", "scale", "add", "reload", "upgrade", "slots",
                     "adapters"]


def test_the_gateways_declared_defaults_are_its_configurations() -> None:
    assert configure({}) == GatewayConfig()


def test_the_gateways_flags_reach_its_configuration() -> None:
    config = configure({"gateway_http": "[::1]:9000", "max_connections": 7, "read_timeout": 2.5,
                        "responses_store_per_key": "1MiB", "allowed_hosts": "a.example, b.example", "insecure": True,
                        "gateway_curve_secret": "client.key_secret"}, exit_with_parent=True)
    assert (config.host, config.port, config.connections.max_connections, config.connections.read_timeout) == \
        ("::1", 9000, 7, 2.5)
    assert (config.responses.per_key, config.allowed_hosts, config.insecure, config.curve_secret) == \
        (1 << 20, ("a.example", "b.example"), True, "client.key_secret")
    assert config.exit_with_parent and config.connections.max_connections_per_client == 256


@pytest.mark.parametrize("args", [["--http-workers", "0"], ["--max-connections", "0"], ["--reattach", "-1"]])
def test_a_gateway_flag_out_of_its_declared_range_is_refused_before_anything_starts(args: list[str]) -> None:
    shown = CliRunner().invoke(app, ["gateway", *args], env={"COLUMNS": "200"})
    assert shown.exit_code == 2 and "Invalid value" in shown.output, shown.output


def test_every_operator_command_takes_the_same_server_and_curve_options() -> None:
    commands = get_command(app).commands  # type: ignore[attr-defined]
    shared = {name: {flag: (p.envvar, p.default, p.help) for p in commands[name].params for flag in p.opts
                     if flag in ("--server-name", "--curve-server-key", "--curve-secret")}
              for name in OPERATOR_COMMANDS}
    assert shared["status"]["--curve-secret"][0] == "MPSERVE_CURVE_CLIENT_SECRET"
    assert {name: options for name, options in shared.items() if options != shared["status"]} == {}


def test_status_json_without_the_brokers_figures_and_devices_without_a_gpu() -> None:
    info = ServerInfo(name="s", pid=1, front="ipc:///x", back="ipc:///w", slots="/dev/shm/x", models=[], started=0.0)
    assert status_json(info, [], None) == {"server": "s", "pid": 1, "address": "ipc:///x", "slots": [],
                                           "remote": [], "scaling": {}, "tenants": {}}
    assert format_devices([], {}) == "no GPU found (no NVML, no nvidia-smi): instances run on the CPU"
