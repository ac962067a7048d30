"""``mpserve.wire.zmqio``: multipart messages through pyzmq's backend calls arrive as ``send_multipart`` sends
them and ``recv_multipart`` takes them, and the non-blocking cases raise as those do."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from mpserve.wire import zmqio

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind("inproc://zmqio")
    dealer.setsockopt(zmq.IDENTITY, b"d")
    dealer.connect("inproc://zmqio")
    yield router, dealer
    ctx.destroy(linger=0)


def test_frames_travel_both_ways_as_the_sugar_sends_and_takes_them(
        pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]) -> None:
    router, dealer = pair
    assert not zmqio.readable(router)
    zmqio.send(dealer, [b"MPS1", b"\x21", b"", b"body" * 1000])
    dealer.send_multipart([b"second"])
    assert router.poll(1000)
    assert zmqio.readable(router)
    assert zmqio.recv(router, zmqio.NOBLOCK) == [b"d", b"MPS1", b"\x21", b"", b"body" * 1000]
    assert zmqio.recv(router) == [b"d", b"second"]
    assert not zmqio.readable(router)
    with pytest.raises(zmq.Again):
        zmqio.recv(router, zmqio.NOBLOCK)
    zmqio.send(router, [b"d", b"one frame"], zmqio.NOBLOCK)
    assert dealer.recv_multipart() == [b"one frame"]


def test_a_send_to_no_one_raises_as_send_multipart_does(pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]) -> None:
    router, _ = pair
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    with pytest.raises(zmq.ZMQError):
        zmqio.send(router, [b"nobody", b"x"], zmqio.NOBLOCK)
