"""The gateway's SQLite file (stored responses and the streams' journal), shared by every gateway process of a port:
a process that opens it (both of its connections) and closes it again while another still uses it leaves the
write-ahead log in place. Closing any descriptor of the file releases the POSIX locks the process's connections
hold on it; the last process to close believes it is alone and deletes the log under the others, whose next
reads then find the file malformed (seen under the chaos bench, as gateway processes drained and exited)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from mpserve.gateway.api.journal import Journal
from mpserve.gateway.api.response_store import ResponseStore, StoreBudget

pytestmark = pytest.mark.timeout(30)

OPEN_AND_CLOSE = """
import asyncio, sys
from pathlib import Path
from mpserve.gateway.api.journal import Journal
from mpserve.gateway.api.response_store import ResponseStore, StoreBudget
path = Path(sys.argv[1])
store, journal = ResponseStore(path, StoreBudget(1 << 20, 1 << 20)), Journal(path)  # as a gateway opens it
asyncio.run(journal.close())
store.close()
"""


def test_a_gateway_process_that_closes_the_file_leaves_the_others_their_write_ahead_log(tmp_path: Path) -> None:
    path = tmp_path / "gateway.sqlite"
    store, journal = ResponseStore(path, StoreBudget(1 << 20, 1 << 20)), Journal(path)
    try:
        journal.begin("owner", "first", "digest")
        subprocess.run([sys.executable, "-c", OPEN_AND_CLOSE, str(path)], check=True, timeout=20)
        assert Path(f"{path}-wal").exists(), "the other process deleted the write-ahead log still in use here"
        journal.begin("owner", "second", "digest")
        assert journal.stream("owner", "first").state == "running"
    finally:
        asyncio.run(journal.close())
        store.close()
