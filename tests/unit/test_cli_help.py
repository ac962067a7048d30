"""What ``--help`` shows: ``mpserve gateway --help`` names every route the gateway serves, and no other (checked
against the app's routes), and no option of any command is labelled with a type it does not take (a flag is no
``<bool>`` value)."""

from __future__ import annotations

import re

import pytest
from starlette.routing import Route
from typer.testing import CliRunner

from mpserve.cli import app as cli
from mpserve.gateway.app import GatewayConfig, create_app

pytestmark = pytest.mark.timeout(30)


def test_gateway_help_names_every_route_the_app_serves() -> None:
    shown = CliRunner().invoke(cli, ["gateway", "--help"], env={"COLUMNS": "2000"})
    assert shown.exit_code == 0, shown.output
    description = shown.output.split("Options", 1)[0]  # above the options, whose help names other paths
    named = {path.rstrip(".") for path in re.findall(r"(?<![\w/])/[\w/{}.-]*", description)}  # whole paths
    routes = {r.path for r in create_app(GatewayConfig(admin_key="an-admin-key")).routes if isinstance(r, Route)}
    assert sorted(routes - named) == [] and sorted(named - routes) == []


@pytest.mark.parametrize("command", ["start", "gateway", "status", "generate", "worker", "slots", "scale"])
def test_a_flag_shows_no_type_label(command: str) -> None:
    shown = CliRunner().invoke(cli, [command, "--help"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "--help" in shown.output and "<bool>" not in shown.output, shown.output
