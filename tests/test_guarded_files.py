"""The API key file and the configuration file are refused when a user other than the server's (or root) may
change them, and the key file when other users may read it, with one line naming the file and the fix; a reload
that meets such a key file keeps the keys in use (before, another user appended a key to a 0666 file and, after a
reload, was served)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import as_other_user, free_port, mpserve, shared_place

from mpserve.config import loader as cfg
from mpserve.errors import ConfigError
from mpserve.gateway.http.access import KeyRing, any_matches, load_keys

pytestmark = pytest.mark.timeout(60)


def key_file(folder: Path, mode: int, text: str = "mine\n") -> Path:
    path = folder / "keys"
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o666], ids=oct)
def test_a_key_file_other_users_may_read_or_write_is_refused_naming_the_fix(tmp_path: Path, mode: int) -> None:
    path = key_file(tmp_path, mode)
    with pytest.raises(ConfigError) as refused:
        load_keys(None, str(path))
    assert f"chmod 600 {path}" in refused.value.message and "\n" not in refused.value.message
    path.chmod(0o600)
    assert load_keys(None, str(path)) == ("mine",)
    (tmp_path / "link").symlink_to(path)  # a mounted secret is a link: the file it names is checked
    assert load_keys(None, str(tmp_path / "link")) == ("mine",)


@pytest.mark.parametrize("mode", [0o666, 0o664, 0o646], ids=oct)
def test_a_configuration_file_others_may_write_is_refused_and_one_they_may_only_read_is_not(
        tmp_path: Path, mode: int) -> None:
    path = tmp_path / "mpserve.yaml"
    path.write_text("max_queue: 5\n")
    path.chmod(mode)
    with pytest.raises(ConfigError, match=f"may be changed by other users .*chmod 600 {path}"):
        cfg.load_file(path)
    path.chmod(0o644)
    assert cfg.load_file(path) == {"max_queue": 5}


def test_a_key_file_another_user_owns_is_refused() -> None:
    with shared_place() as shared:
        path = shared / "keys"
        assert as_other_user(lambda: key_file(shared, 0o600, "theirs\n")) == "ok"
        with pytest.raises(ConfigError, match=f"belongs to user 65534, who may change it.*chmod 600 {path}"):
            load_keys(None, str(path))


def test_a_reload_keeps_the_keys_in_use_when_the_key_file_became_writable_by_others(tmp_path: Path) -> None:
    path = key_file(tmp_path, 0o600)
    ring = KeyRing(None, str(path), load_keys(None, str(path)))
    path.chmod(0o666)
    path.write_text("mine\nplanted by another user\n")
    ring.reload()
    assert any_matches(b"Bearer mine", ring.expected)
    assert not any_matches(b"Bearer planted by another user", ring.expected)


def test_a_start_with_a_key_file_others_may_read_ends_with_one_line(tmp_path: Path) -> None:
    path = key_file(tmp_path, 0o644)
    run = mpserve("start", "--model", "echo", "--http", f"127.0.0.1:{free_port()}", "--api-key-file", str(path),
                  timeout=50)
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip().splitlines() == [f"error: [config] the API key file {path} may be read by other users "
                                               f"(mode 0644); close it: chmod 600 {path}"]
