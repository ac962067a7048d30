"""The examples in examples/ keep working: the client scripts against a running server, the YAML as a config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mpserve.config import loader as cfg

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.timeout(120)
def test_the_client_examples_run_against_the_default_server(start_server) -> None:
    start_server("--instances", "2", name="default").wait_ready()  # the examples name no server
    for script, says in (("sync_client.py", "finish reason 'length'"), ("async_client.py", "16 requests, 1024 tokens")):
        run = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=90)
        assert run.returncode == 0 and says in run.stdout, (script, run.stdout, run.stderr)


@pytest.mark.timeout(30)
def test_the_example_config_is_valid() -> None:
    path = EXAMPLES / "two_models.yaml"
    config = cfg.build(cfg.load_file(path), source=str(path), base_dir=path.parent)
    assert [(m.name, m.instances) for m in config.models] == [("tiny", 2), ("bench", 1)]
