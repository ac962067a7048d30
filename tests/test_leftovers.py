"""What a server leaves behind (issue 58): after a start, a kill -9, a start again (which adopts what the first left),
an upgrade and a clean stop, no process of the server's is left (its zygote, the zygote's spare, its instances, the fork
server, multiprocessing's resource tracker) and its runtime folder is empty (the zygote's sockets and the stored
responses' file of its HTTP port removed too). The adoption wait is longer than the test waits, so a process that
waits to be adopted after the clean stop fails it."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ServerProcess
from helpers import free_port, mpserve, wait_for

ADOPT_WAIT_S = "600"  # what a process that outlived a server waits for its next start: the test never waits as long


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A runtime folder of this test's alone, its path short enough for the zygotes' unix sockets."""
    folder = Path(tempfile.mkdtemp(prefix="mpl-", dir="/tmp"))
    monkeypatch.setenv("MPSERVE_RUNTIME_DIR", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def processes_of(runtime: Path) -> dict[int, str]:
    """Each process whose command line or environment names the runtime folder ``runtime``, with its command."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:  # gone, or not ours
            continue
        if str(runtime).encode() in command + environ and int(pid) != os.getpid():
            found[int(pid)] = command.replace(b"\0", b" ").decode(errors="replace")[:120]
    return found


@pytest.mark.timeout(180)
def test_a_kill_a_restart_and_a_stop_leave_no_process_and_no_file(start_server: type[ServerProcess],
                                                                     runtime: Path) -> None:
    args = ("--model", "builtin:tiny", "--instances", "2", "--threads", "1", "--adopt-wait", ADOPT_WAIT_S,
            "--http", f"127.0.0.1:{free_port()}")
    first = start_server(*args).wait_ready()
    first.stop(9)
    wait_for(lambda: any(".zygote-" in p.name for p in runtime.iterdir()), what="the zygote waiting to be adopted")
    second = start_server(*args, name=first.name).wait_ready()
    assert any("adopted" in line for line in second.log), "\n".join(second.log)
    upgraded = mpserve("upgrade", "--server-name", first.name)  # the same process, executed again: it adopts all
    assert upgraded.returncode == 0, upgraded.stderr
    assert second.stop() == 0
    wait_for(lambda: not processes_of(runtime), timeout=60, what=f"no process left: {processes_of(runtime)}")
    assert sorted(p.name for p in runtime.iterdir()) == []
