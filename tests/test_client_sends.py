"""AsyncClient's sends against a fake server (a ROUTER in a thread): in order, and none lost when the socket
is full (its high-water mark reached) until the server reads again."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import zmq

from mpserve import AsyncClient
from mpserve.wire import protocol as wire

pytestmark = pytest.mark.timeout(60)

MESSAGES = 20_000  # far more than the client's and the server's high-water marks (1000 each) hold


class FakeServer(threading.Thread):
    """Answers the client's first PING, then reads nothing until ``release`` is set, then every message,
    recording the ids of the CANCELs (answering later PINGs too)."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.release = threading.Event()
        self.cancelled: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        pinged = False
        while not self.done.is_set():
            if pinged and not self.release.wait(0.01):
                continue
            if not self.sock.poll(100):
                continue
            peer, *frames = self.sock.recv_multipart()
            msg = wire.decode(frames)
            if isinstance(msg, wire.Ping):
                self.sock.send_multipart([peer, *wire.encode(wire.Pong(msg.nonce, ("m",)))])
                pinged = True
            elif isinstance(msg, wire.Cancel):
                self.cancelled.append(msg.id)
                if len(self.cancelled) == MESSAGES:
                    self.done.set()
        self.sock.close()
        self.ctx.term()


def test_sends_past_the_high_water_mark_wait_for_room_and_all_arrive_in_order(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/fake.sock"
    server = FakeServer(address)
    server.start()

    async def main() -> None:
        async with AsyncClient(address) as client:
            sends = [asyncio.ensure_future(client.cancel(f"c{i}")) for i in range(MESSAGES)]
            await asyncio.sleep(0.5)  # not a wait: time for sends that would not block to have gone
            assert not all(s.done() for s in sends), "the socket never filled: the test sends too little"
            server.release.set()
            await asyncio.wait_for(asyncio.gather(*sends), 30)
            await asyncio.get_running_loop().run_in_executor(None, server.done.wait, 30)

    asyncio.run(main())
    assert server.cancelled == [f"c{i}" for i in range(MESSAGES)]
