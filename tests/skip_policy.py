"""No silent skips: a run in which any test is skipped fails, unless that skip is on ``tests/allowed_skips.txt``.

    every skip (a test's, or a whole module's at collection) ─▶ listed? (node id glob and words of the reason)
        yes ─▶ reported in the summary as allowed, with the list's reason
        no  ─▶ reported as not allowed, and the run's exit status becomes 1 (a green run skipped nothing it may not)

The list is short on purpose: each entry says why that skip cannot be avoided on some hosts. A skip that only
means "something is missing from this machine" belongs in the set-up (the lock, .ci/run), not in the list.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

import pytest

ALLOWED_FILE = Path(__file__).with_name("allowed_skips.txt")


@dataclass(frozen=True)
class Allowed:
    pattern: str  # a node id glob
    reason: str  # words the skip's reason contains
    why: str  # why this skip may happen


def read_allowed(path: Path = ALLOWED_FILE) -> list[Allowed]:
    """``NODE-ID-GLOB | WORDS OF THE REASON | WHY IT IS ALLOWED`` a line; ``#`` starts a comment."""
    allowed = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = [p.strip() for p in line.split(" | ")]
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"{path}:{number}: expected 'NODE-ID-GLOB | REASON WORDS | WHY', got {line!r}")
        allowed.append(Allowed(*parts))
    return allowed


def allowed_for(nodeid: str, reason: str, allowed: list[Allowed]) -> Allowed | None:
    return next((a for a in allowed if fnmatch.fnmatchcase(nodeid, a.pattern) and a.reason in reason), None)


class SkipPolicy:
    def __init__(self, allowed: list[Allowed]) -> None:
        self.allowed = allowed
        self.seen: list[tuple[str, str, Allowed | None]] = []

    def _record(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        if not report.skipped or getattr(report, "wasxfail", None) is not None:
            return
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        self.seen.append((report.nodeid, reason, allowed_for(report.nodeid, reason, self.allowed)))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._record(report)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._record(report)

    @property
    def refused(self) -> list[tuple[str, str]]:
        return [(nodeid, reason) for nodeid, reason, ok in self.seen if ok is None]

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.refused and exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.seen:
            return
        terminalreporter.section("skips")
        for nodeid, reason, ok in self.seen:
            verdict = f"allowed ({ok.why})" if ok is not None else "NOT ALLOWED"
            terminalreporter.write_line(f"{verdict}: {nodeid}: {reason}")
        if self.refused:
            terminalreporter.write_line(
                f"{len(self.refused)} skip(s) not on {ALLOWED_FILE.name}: install what they name (the README's "
                "set-up does), or list the skip there with the reason it cannot be avoided", red=True)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SkipPolicy(read_allowed()), "mpserve-skip-policy")
