"""The house rules on size: no module of mpserve/ over 600 lines, no function (or method) over 60. What is over them
today is listed below with its count, so it cannot grow; an entry that is back within the rule must be removed, so
the list only shrinks. A function's length runs from its ``def`` to its last line (decorators not counted); a
module's is its line count, as ``wc -l`` gives it."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mpserve"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60

ALLOWED = {  # path, or path::qualified name: its count when it was listed
    "mpserve/cli.py": 652,
    "mpserve/client.py": 890,
    "mpserve/config/loader.py": 691,
    "mpserve/gpu/permits.py": 705,
    "mpserve/wire/messages.py": 951,
}

pytestmark = pytest.mark.timeout(30)


def _functions(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """Each function and method under ``node``, by qualified name (``Class.method``, ``outer.inner``), with its
    length in lines."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert child.end_lineno is not None
            yield prefix + child.name, child.end_lineno - child.lineno + 1
            yield from _functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, prefix)


def sizes(package: Path = PACKAGE) -> dict[str, int]:
    """What is over the rules in ``package``: each module over MAX_MODULE_LINES and each function over
    MAX_FUNCTION_LINES, with its count."""
    over = {}
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package.parent).as_posix()
        text = path.read_text()
        if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
            over[name] = lines
        over |= {f"{name}::{function}": length for function, length in _functions(ast.parse(text))
                 if length > MAX_FUNCTION_LINES}
    return over


def test_no_module_or_function_grows_past_the_rules() -> None:
    grown = {name: f"{count} lines (allowed: {ALLOWED.get(name, 'none: split it')})"
             for name, count in sizes().items() if count > ALLOWED.get(name, 0)}
    assert grown == {}, (f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function; split it "
                         f"rather than raise its entry in tests/unit/test_house.py's ALLOWED")


def test_the_allow_list_names_only_what_is_still_over() -> None:
    over = sizes()
    within = sorted(name for name in ALLOWED if name not in over)
    assert within == [], "back within the rules: remove them from ALLOWED in tests/unit/test_house.py"


def test_a_long_function_and_a_long_module_are_found(tmp_path: Path) -> None:
    package = tmp_path / "mpserve"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    (package / "short.py").write_text(f"def fits():\n{body[:body.rindex(chr(10))]}\n")
    (package / "long.py").write_text(f"class C:\n    def m(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n"
                                     + "\n" * 600)
    assert sizes(package) == {"mpserve/long.py": 662, "mpserve/long.py::C.m": 61}
