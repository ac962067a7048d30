"""A Python child of mpserve's imports nothing from the folder it was started in (``mpserve.children``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import mpserve
from mpserve import children
from mpserve.errors import ConfigError

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


def test_a_start_whose_children_would_import_another_mpserve_is_refused_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    children.check_importable()  # this process's mpserve: theirs too
    (tmp_path / "mpserve").mkdir()  # a folder named mpserve first on their path: they could start nothing
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(ConfigError) as refused:
        children.check_importable()
    assert f"would import mpserve from {tmp_path / 'mpserve'}, not from this server's " in refused.value.message
    assert "\n" not in refused.value.message
