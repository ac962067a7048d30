"""The engine stays split by job: no module of ``mpserve/engine`` over MAX_MODULE_LINES lines, no function over
MAX_FUNCTION_LINES (measured with ``ast``, docstring included). A module or function that grows past them is split
by what it does, as ``batch`` was into ``sequence``, ``scheduler``, ``cells``, ``keeping`` and ``context``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mpserve.engine

pytestmark = pytest.mark.timeout(10)

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
ENGINE = Path(mpserve.engine.__file__).parent


def sizes(source: str) -> list[tuple[str, int]]:
    """Each function's (method's, nested function's) qualified name and lines, from ``def`` to its last line."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert child.end_lineno is not None
                found.append((prefix + child.name, child.end_lineno - child.lineno + 1))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_the_measure_counts_methods_and_nested_functions_from_def_to_their_end() -> None:
    source = "class A:\n    def f(self):\n        def g():\n            pass\n\n        return g\n"
    assert sizes(source) == [("A.f", 5), ("A.f.g", 2)]


def test_no_engine_module_or_function_is_too_long() -> None:
    modules = sorted(ENGINE.glob("*.py"))
    assert {path.name for path in modules} >= {"batch.py", "cells.py", "context.py", "keeping.py", "scheduler.py",
                                               "sequence.py"}
    long_modules = {path.name: n for path in modules if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    long_functions = {f"{path.name}:{name}": n for path in modules for name, n in sizes(path.read_text())
                      if n > MAX_FUNCTION_LINES}
    assert long_modules == {}, f"split these modules by job (over {MAX_MODULE_LINES} lines)"
    assert long_functions == {}, f"split these functions (over {MAX_FUNCTION_LINES} lines)"


def test_the_engine_package_map_lists_every_module() -> None:
    listed = mpserve.engine.__doc__ or ""
    missing = [path.stem for path in sorted(ENGINE.glob("*.py"))
               if path.stem != "__init__" and f"\n    {path.stem} " not in listed]
    assert missing == [], "mpserve/engine/__init__.py's map lacks these modules"
