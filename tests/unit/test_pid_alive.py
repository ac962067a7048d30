"""``pid_alive``: a process that was killed but not yet reaped by its parent (a zombie) is not alive, so a reader
that asks whether a stream's producer died gets the answer its death gives, not the one its parent's reaping does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import wait_for

from mpserve.runtime import pid_alive


@pytest.mark.timeout(30)
def test_a_killed_process_is_not_alive_before_its_parent_reaps_it() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert pid_alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        wait_for(lambda: Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", 10,
                 "the child to be a zombie")
        assert not pid_alive(child.pid)  # not reaped yet: kill(pid, 0) alone still finds it
    finally:
        child.kill()
        child.wait(10)
    assert not pid_alive(child.pid)
