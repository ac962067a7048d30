"""The Node.js client reattaches after its server's death as the Python client does (``test_adoption``): the server
SIGKILLed under 4 greedy streams and started again 5 s later, each stream finishes with the text of an uninterrupted
run, none of it twice; with ``reattach: 0`` they fail ``connection`` at the first silence instead."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from typing import Any

import pytest
from test_adoption import ARGS, _kill_frozen, _worker_pids, freeze_generating
from test_node_client import NODE_CLIENT, _node

from mpserve import Client
from mpserve.client import PING_INTERVAL_S, PING_LIVENESS

PROMPTS = [f"Once upon a time, {i} " for i in range(4)]
MAX_TOKENS = 600


class _NodeStreams:
    """``clients/node/test/reattach.mjs`` streaming PROMPTS; ``seen()`` waits for its end and gives each stream's
    text, result, longest pause and error."""

    def __init__(self, address: str, reattach: float) -> None:
        self.proc = subprocess.Popen([_node(), "test/reattach.mjs", address, str(reattach), str(MAX_TOKENS), *PROMPTS],
                                     cwd=NODE_CLIENT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.append(line)

    def ended(self) -> bool:
        return self.proc.poll() is not None

    def seen(self, timeout: float) -> list[dict[str, Any]]:
        self.proc.wait(timeout)
        self._reader.join(5)
        assert self.proc.stderr is not None
        assert self.proc.returncode == 0, self.proc.stderr.read()
        streams: list[dict[str, Any]] = json.loads(self._lines[-1])
        return streams


def _frozen_mid_way(server, pids: list[int], reattach: float) -> _NodeStreams:
    """Node streams of PROMPTS, their instances stopped while every one generates: however fast the model, none
    ends before the server is gone. Where one ended before the stop could come (a client told late of its first
    piece was how it happened beside a busy core), they run again."""
    for _ in range(3):
        node = _NodeStreams(server.address, reattach)
        if freeze_generating(server, pids, len(PROMPTS), node.ended):
            return node
        node.seen(120)
    pytest.fail("three times, a Node stream ended before its instance could be stopped")


@pytest.mark.timeout(180)
def test_node_streams_of_a_server_killed_and_started_again_5_s_later_finish_each_exactly(start_server) -> None:
    server = start_server(*ARGS).wait_ready()
    with Client(server.address) as client:
        whole = [client.generate(p, max_tokens=MAX_TOKENS, temperature=0).text for p in PROMPTS]
    pids = _worker_pids(server)
    node = _frozen_mid_way(server, pids, reattach=30)
    _kill_frozen(server, pids)
    time.sleep(5)  # not a wait: what a service manager's restart delay does
    again = start_server(*ARGS, name=server.name).wait_ready()
    streams = node.seen(120)
    assert [s["error"] for s in streams] == [None] * len(PROMPTS)
    assert [s["text"] for s in streams] == whole, "a stream's text differs from its uninterrupted run"
    assert [s["result"] for s in streams] == whole
    with Client(again.address) as client:
        counters = client.stats().counters
    assert counters.get("reattached", 0) == len(PROMPTS), (  # what to look at when they ran anew instead
        counters, [s["pause"] for s in streams], "\n".join(server.log[-30:] + again.log[-30:]))
    pauses = sorted(s["pause"] for s in streams)
    print(f"\nserver SIGKILLed under {len(PROMPTS)} Node streams, started again 5 s later: all exact; longest pause "
          f"per stream {', '.join(f'{p:.1f}' for p in pauses)} s")
    assert not again.tracebacks(), "\n".join(again.log)


@pytest.mark.timeout(120)
def test_node_streams_with_reattach_0_fail_connection_at_the_first_silence(start_server) -> None:
    server = start_server(*ARGS).wait_ready()
    pids = _worker_pids(server)
    node = _frozen_mid_way(server, pids, reattach=0)
    _kill_frozen(server, pids)
    killed = time.monotonic()
    streams = node.seen(60)
    failed_s = time.monotonic() - killed
    assert [s["error"]["code"] for s in streams] == ["connection"] * len(PROMPTS), streams
    assert all("stopped answering" in s["error"]["message"] for s in streams), streams
    assert failed_s < PING_INTERVAL_S * (PING_LIVENESS + 1) + 2.0, failed_s
    start_server(*ARGS, name=server.name).wait_ready()  # adopts the instances left, and stops them after the test
