"""The remote tier's settings: an address mpserve may use, never with a password in it; a password file that is a
secret; what the worker is given."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mpserve.config import loader as cfg
from mpserve.config.remote_tier import RemoteTier
from mpserve.errors import ConfigError

pytestmark = pytest.mark.timeout(30)


def model(**values: object) -> cfg.ModelConfig:
    return cfg.build({"models": [values]}).models[0]


def test_the_worker_gets_the_address_ttl_size_and_password_file(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    tier = model(cache_remote="rediss://mpserve@cache.example:6380/2", cache_remote_ttl=60,
                 cache_remote_size="1MiB", cache_remote_password_file=str(secret)).remote_tier()
    assert tier == RemoteTier("rediss://mpserve@cache.example:6380/2", 60, 1 << 20, str(secret))
    assert model().remote_tier() is None
    assert model(cache_remote="redis://127.0.0.1:6379/0", cache_ram=0).remote_tier() is None  # no RAM tier


@pytest.mark.parametrize(("url", "why"), [
    ("redis://user:pw@127.0.0.1:6379/0", "holds a password"),
    ("redis://:pw@127.0.0.1:6379/0", "holds a password"),
    ("http://127.0.0.1:6379/0", "not a Redis address"),
    ("redis://127.0.0.1/0", "names no port"),
    ("redis://127.0.0.1:6379/zero", "not a number"),
    ("redis://127.0.0.1:99999/0", "not an address"),
])
def test_an_address_mpserve_cannot_use_is_refused_with_its_key(url: str, why: str) -> None:
    with pytest.raises(ConfigError, match=rf"models\[0\]\.cache_remote: .*{why}"):
        model(cache_remote=url)


def test_a_password_file_others_may_read_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    os.chmod(secret, 0o644)
    with pytest.raises(ConfigError, match="password file"):
        model(cache_remote="redis://127.0.0.1:6379/0", cache_remote_password_file=str(secret))
    with pytest.raises(ConfigError, match=r"cache_remote_password_file: cannot read"):
        model(cache_remote="redis://127.0.0.1:6379/0", cache_remote_password_file=str(tmp_path / "missing"))
