"""A Python child of mpserve's imports nothing from the folder it was started in (``mpserve.children``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import mpserve
from mpserve import children

pytestmark = pytest.mark.timeout(30)

CODE = "import mpserve; print(mpserve.__file__)"


@pytest.mark.parametrize("args", [("-m", "mpserve.children"), ("-c", CODE)], ids=["module", "code"])
def test_a_child_imports_the_installed_mpserve_not_one_in_its_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: tuple[str, str]) -> None:
    (tmp_path / "mpserve").mkdir()
    (tmp_path / "mpserve" / "__init__.py").write_text("raise SystemExit('the planted mpserve ran')\n")
    monkeypatch.chdir(tmp_path)
    done = subprocess.run(children.python(*args), capture_output=True, text=True, timeout=20)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() in ("", mpserve.__file__)
