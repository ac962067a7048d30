"""Each package's ``__init__`` docstring is its map: every module (and subpackage) of it on a line of its own,
``    name   what it does``, so that a newcomer finds where a thing lives from the maps alone; a module added,
moved or renamed without its line fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "mpserve"


def _listed(package: Path) -> set[str]:
    """The names that open a line of the map (four spaces in or more, as ``name``, ``name/`` or ``name.py``); a
    subpackage's modules may be drawn in its parent's map instead, a level further in."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()), clean=False) or ""
    listed = set(re.findall(r"^ {4,}([A-Za-z_]\w*)(?:/|\.py)?(?:\s|$)", doc, re.MULTILINE))
    return listed | (_listed(package.parent) if PACKAGE not in (package, package.parent) else set())


def _members(package: Path) -> set[str]:
    modules = {p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")}
    return modules | {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}


PACKAGES = sorted(str(p.parent.relative_to(PACKAGE)) for p in PACKAGE.glob("*/**/__init__.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_map_lists_each_of_its_modules(package: str) -> None:
    folder = PACKAGE / package
    assert sorted(_members(folder) - _listed(folder)) == [], f"mpserve/{package}/__init__.py's map misses them"


def test_the_top_map_lists_each_package_and_module() -> None:
    assert sorted(_members(PACKAGE) - _listed(PACKAGE)) == [], "mpserve/__init__.py's map misses them"


def test_the_cli_map_names_every_command() -> None:
    from mpserve.cli import app

    commands = {c.name or (c.callback.__name__ if c.callback else "") for c in app.registered_commands}
    words = set(re.findall(r"[a-z][a-z-]*", ast.get_docstring(ast.parse((PACKAGE / "cli.py").read_text())) or ""))
    assert sorted(commands - words) == [], "mpserve/cli.py's docstring misses these commands"
