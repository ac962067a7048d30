"""The declarations (settings, error codes) agree with the config dataclasses and the CLI; the docs' tables are
generated from them (tests/test_docs.py checks they are whole)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from typer.main import get_command

from mpserve import errors
from mpserve.cli import app
from mpserve.config import loader as cfg
from mpserve.config import settings
from mpserve.config.sizes import parse_memory

pytestmark = pytest.mark.timeout(10)


def test_every_error_code_has_a_table_row_and_an_exception_class() -> None:
    assert set(errors.CODES) == set(errors.ErrorCode)
    for code in errors.ErrorCode:
        assert errors.error_from_code(code.value, "m").code is code


@pytest.mark.parametrize("config_class, scope", [(cfg.ServerConfig, "server"), (cfg.ModelConfig, "model")])
def test_declared_defaults_are_the_dataclass_defaults(config_class: type, scope: settings.Scope) -> None:
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    for s in settings.scoped(scope):
        if s.key == "requires":  # YAML's requires: {memory} is the field requires_memory
            continue
        default = fields[s.key].default
        if default is None or default is dataclasses.MISSING or default == ():
            continue  # described in words ("every GPU found", "none")
        if s.key in ("cache_ram", "cache_disk_size", "cache_remote_size"):  # a size, shown as people write it
            assert parse_memory(s.default) == default, (s.key, default, s.default)
            continue
        shown = f"{default:g}" if isinstance(default, float) else str(default).lower()
        assert re.match(rf"{re.escape(shown)}\b", s.default), (s.key, default, s.default)


@pytest.mark.parametrize("command", ["start", "worker", "plan", "devices", "gateway"])
def test_each_command_has_the_flags_declared_for_it(command: settings.Command) -> None:
    click_command = get_command(app).commands[command]  # type: ignore[attr-defined]
    flags = {opt for param in click_command.params for opt in param.opts}
    for s in settings.for_command(command):
        assert s.flag in flags and (s.short is None or s.short in flags), (command, s.key)
        param = next(p for p in click_command.params if s.flag in p.opts)
        assert param.envvar == s.env and s.default in (param.help or ""), (command, s.key)


@pytest.mark.parametrize("command", ["start", "worker", "plan", "devices", "gateway"])
def test_each_command_takes_no_setting_flag_that_is_not_declared_for_it(command: settings.Command) -> None:
    """The configuration page says which commands take each flag; a command with more would contradict it."""
    click_command = get_command(app).commands[command]  # type: ignore[attr-defined]
    flags = {opt for param in click_command.params for opt in param.opts}
    declared = {s.flag for s in settings.SETTINGS if command in (*s.commands, *s.own_in)}
    assert {s.flag for s in settings.SETTINGS if s.flag in flags} <= declared, command
