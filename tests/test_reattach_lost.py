"""A reattached request that never reached a server (``mpserve.client``, ``clients/node``): after its server died, a
client sends its request again on a new connection, and that connection may meet another listener first, one that
takes the request and closes (a server dying as it starts; until it was fixed, ``mpserve start``'s own check of its
address, which bound it for a moment: ``tests/test_start_checks.py``). The next start answers the client's pings
without knowing the request: unless the client sends it again, the stream waits for its timeout.

The tests make that certain with a relay at the clients' address: the next start listens elsewhere; the relay drops
everything until a client went silent and sent its request again, then passes every message both ways, except that
it drops each reattached REQUEST a connection sends before the server has answered that connection once (as the
other listener would have):

    client ──DEALER──▶ relay (ROUTER at the dead server's address) ──a DEALER per connection──▶ next start
           ◀────────── every answer passed back ◀──────────────────────────────────────────────┘
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import zmq
from test_adoption import ARGS, _kill_frozen, _streams_frozen_mid_way, _worker_pids
from test_node_reattach import PROMPTS as NODE_PROMPTS
from test_node_reattach import _frozen_mid_way

from mpserve import Client
from mpserve.errors import MpserveError
from mpserve.wire import protocol as wire

PROMPT = "Once upon a time, a listener "
MAX_TOKENS = 600


class _Relay(threading.Thread):
    """The relay drawn above, at ``front``: closed (it drops everything) until ``open`` gives it the server's
    address; ``reattached`` is set once a client sent a reattached REQUEST (it went silent, and sent its request again
    on a new connection); ``resent`` counts those it passed on (each sent after the server had answered that
    connection: the only ones that reach it)."""

    def __init__(self, front: Path) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.front.bind(f"ipc://{front}")
        self.server: str | None = None
        self.reattached = threading.Event()
        self.resent = 0
        self.done = threading.Event()
        self._backs: dict[bytes, zmq.Socket] = {}
        self._answered: set[bytes] = set()  # the connections the server answered once

    def open(self, server: str) -> None:
        self.server = server

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        while not self.done.is_set():
            for sock, _ in poller.poll(20):
                if sock is self.front:
                    frames = self.front.recv_multipart()
                    self._to_server(poller, frames[0], frames[1:])
                else:
                    identity = next(i for i, back in self._backs.items() if back is sock)
                    self._answered.add(identity)
                    self.front.send_multipart([identity, *sock.recv_multipart()])
        for back in self._backs.values():
            back.close(0)
        self.front.close(0)
        self.ctx.term()

    def _to_server(self, poller: zmq.Poller, identity: bytes, frames: list[bytes]) -> None:
        try:
            msg = wire.decode(frames)
        except MpserveError:
            msg = None
        if isinstance(msg, wire.Request) and msg.reattach:
            self.reattached.set()
            if identity not in self._answered:
                return
            self.resent += 1
        if self.server is None:
            return
        if identity not in self._backs:
            back = self._backs[identity] = self.ctx.socket(zmq.DEALER)
            back.setsockopt(zmq.LINGER, 0)
            back.connect(self.server)
            poller.register(back, zmq.POLLIN)
        self._backs[identity].send_multipart(frames)


def _restart_behind_a_relay(start_server, server, pids: list[int], tmp_path: Path):
    """SIGKILL ``server`` under its frozen streams, put the relay at the clients' address, start the server again at
    another address, and open the relay to it once it is ready and a client sent its request again (their
    connections' next answer comes from that start)."""
    front = Path(server.address[len("ipc://"):])
    _kill_frozen(server, pids)
    front.unlink()
    relay = _Relay(front)
    relay.start()
    again = start_server(*ARGS, "--bind", f"ipc://{tmp_path / 'next.sock'}", name=server.name).wait_ready()
    assert relay.reattached.wait(60), "no client sent its request again after its server went silent"
    relay.open(again.address)
    return again, relay


@pytest.mark.timeout(180)
def test_a_reattached_request_dropped_before_the_next_start_answered_is_sent_again(start_server, tmp_path) -> None:
    server = start_server(*ARGS).wait_ready()
    with Client(server.address) as client:
        whole = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0).text
    pids = _worker_pids(server)
    [stream] = _streams_frozen_mid_way(server, pids, [PROMPT])
    again, relay = _restart_behind_a_relay(start_server, server, pids, tmp_path)
    try:
        stream.join(150)
    finally:
        relay.done.set()
    assert stream.error is None, stream.error
    assert relay.resent >= 1
    assert stream.text == whole
    again.stop()
    assert not again.tracebacks(), "\n".join(again.log)


@pytest.mark.timeout(180)
def test_the_node_client_sends_a_reattached_request_dropped_before_the_next_start_answered_again(
        start_server, tmp_path) -> None:
    server = start_server(*ARGS).wait_ready()
    with Client(server.address) as client:
        whole = [client.generate(p, max_tokens=MAX_TOKENS, temperature=0).text for p in NODE_PROMPTS]
    pids = _worker_pids(server)
    node = _frozen_mid_way(server, pids, reattach=30)
    started = time.monotonic()
    again, relay = _restart_behind_a_relay(start_server, server, pids, tmp_path)
    try:
        streams = node.seen(150)
    finally:
        relay.done.set()
    assert [s["error"] for s in streams] == [None] * len(NODE_PROMPTS), (streams, time.monotonic() - started)
    assert [s["text"] for s in streams] == whole
    assert relay.resent >= len(NODE_PROMPTS)
    again.stop()
    assert not again.tracebacks(), "\n".join(again.log)
