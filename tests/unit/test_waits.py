"""The suite waits for conditions, not for time: a test that sleeps for something it could watch (a request to
be queued, a batch to be written) passes on a quiet machine and fails beside a busy core.

Each ``time.sleep`` and ``asyncio.sleep`` in tests/ is either inside a ``while`` loop (a poll that checks its
condition again after the pause) or says on its line, after ``# not a wait:``, why no condition can stand in for it
(time itself is what is measured, a process plays a slow peer, or what is checked is that nothing happens)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
MARK = "# not a wait:"


def _sleeps(tree: ast.AST) -> list[tuple[ast.Call, bool]]:
    """Every ``….sleep(…)`` call in ``tree``, and whether a ``while`` loop of its own function holds it."""
    found: list[tuple[ast.Call, bool]] = []

    def visit(node: ast.AST, polled: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
                continue
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and child.func.attr == "sleep":
                found.append((child, polled))
            visit(child, polled or isinstance(child, ast.While))

    visit(tree, False)
    return found


def bare_sleeps(source: str) -> list[int]:
    """The lines of ``source`` that sleep outside a poll without saying why."""
    lines = source.splitlines()
    return [call.lineno for call, polled in _sleeps(ast.parse(source))
            if not polled and not any(MARK in line for line in lines[call.lineno - 1:call.end_lineno])]


@pytest.mark.timeout(30)
def test_no_test_sleeps_for_a_condition_it_could_wait_on() -> None:
    found = [f"{path.relative_to(TESTS.parent)}:{line}" for path in sorted(TESTS.rglob("*.py"))
             for line in bare_sleeps(path.read_text())]
    assert not found, (
        f"a sleep outside a poll: {', '.join(found)}. Wait for the condition instead (tests/helpers.py's wait_for, "
        f"or a while loop that checks it), or say on the line why none can stand in for it: {MARK} …")


@pytest.mark.timeout(30)
def test_the_check_tells_a_poll_and_a_reasoned_pause_from_a_bare_sleep() -> None:
    source = (
        "import time\n"
        "def poll(ready):\n"
        "    while not ready():\n"
        "        time.sleep(0.05)\n"
        "def measured():\n"
        "    time.sleep(1)  # not a wait: the idle second is what is measured\n"
        "def bare(start):\n"
        "    start()\n"
        "    time.sleep(0.5)  # the request is queued by now\n"
        "def nested(ready):\n"
        "    while not ready():\n"
        "        def inner():\n"
        "            time.sleep(1)\n"
        "        inner()\n")
    assert bare_sleeps(source) == [9, 13]
