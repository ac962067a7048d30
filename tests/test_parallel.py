"""Two instances of the bench model really compute at the same time (seen in the slot table)."""

from __future__ import annotations

import threading
import time

import pytest

from mpserve import Client
from mpserve.slots import SlotState


@pytest.mark.timeout(180)
def test_two_instances_run_two_requests_at_once(start_server) -> None:
    server = start_server("--model", "builtin:bench", "--instances", "2", "--threads", "1",
                          "--n-ctx", "1024").wait_ready(120)
    overlap_samples = 0
    both_progressing = 0
    with Client(server.address) as client:
        threads = [threading.Thread(target=client.generate, args=(p,), kwargs={"max_tokens": 300, "temperature": 0})
                   for p in ("first prompt", "second prompt")]
        for t in threads:
            t.start()
        previous = None
        while any(t.is_alive() for t in threads):
            rows = server.slots()
            if all(r.state is SlotState.BUSY for r in rows):
                overlap_samples += 1
                if previous is not None and all(r.tokens > p.tokens for r, p in zip(rows, previous, strict=True)):
                    both_progressing += 1
                previous = rows
            time.sleep(0.02)
        for t in threads:
            t.join()
    rows = server.slots()
    assert [r.served for r in rows] == [1, 1]
    assert overlap_samples >= 3 and both_progressing >= 1
