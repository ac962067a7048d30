"""Multipart messages in and out of plain (not asyncio) ZeroMQ sockets, through pyzmq's backend calls with
plain int flags: the broker, the worker and the clients send and receive every message here.

    send(sock, frames, NOBLOCK)   a frame at a time, SNDMORE on all but the last
    recv(sock, NOBLOCK)           a frame at a time while RCVMORE
    recv_keyed(sock, NOBLOCK)     the same, and the CURVE key its peer proved (the first frame's User-Id)
    readable(sock)                a message is waiting (EVENTS & POLLIN), without a receive that fails
    events(sock)                  EVENTS: POLLIN and POLLOUT as ints

pyzmq's ``send_multipart`` and ``recv_multipart`` do the same through its Python layer (``zmq.sugar``),
which builds IntFlag enums for every flag it combines and checks each frame's type, and a receive that
ends on ``zmq.Again`` raises. At one request in flight that is several microseconds per message on
the latency path, in every process.
"""

from __future__ import annotations

from typing import Any, cast

import zmq
from zmq.backend import Socket as _Backend

NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
_EVENTS = int(zmq.EVENTS)
POLLIN = int(zmq.POLLIN)
POLLOUT = int(zmq.POLLOUT)
_send = _Backend.send
_recv = _Backend.recv
_get = _Backend.get


def send(sock: zmq.Socket[Any], frames: list[bytes], flags: int = 0) -> None:
    """Send one multipart message; zmq.Again (with NOBLOCK) or ZMQError as ``send_multipart`` would raise."""
    more = flags | _SNDMORE
    for i in range(len(frames) - 1):
        _send(sock, frames[i], more)
    _send(sock, frames[-1], flags)


def recv(sock: zmq.Socket[Any], flags: int = 0) -> list[bytes]:
    """Receive one multipart message (its frames as bytes)."""
    frames = [_recv(sock, flags)]
    while _get(sock, _RCVMORE):
        frames.append(_recv(sock, flags))
    return frames


def recv_keyed(sock: zmq.Socket[Any], flags: int = 0) -> tuple[list[bytes], str]:
    """Receive one multipart message, and the key its peer proved (CURVE: the authenticator's ``User-Id``, the
    public key in Z85; "" on a socket without CURVE). The first frame is taken whole, as a Frame, to read it."""
    first = _recv(sock, flags, False)
    try:
        key = first.get("User-Id")
    except zmq.ZMQError:  # no such property: no authenticator on this socket
        key = ""
    frames = [first.bytes]
    while _get(sock, _RCVMORE):
        frames.append(_recv(sock, flags))
    return frames, key if isinstance(key, str) else ""


def readable(sock: zmq.Socket[Any]) -> bool:
    """Whether a message is waiting on ``sock``."""
    return bool(cast(int, _get(sock, _EVENTS)) & POLLIN)


def events(sock: zmq.Socket[Any]) -> int:
    """``sock``'s EVENTS (POLLIN: a message is waiting; POLLOUT: a message would be taken)."""
    return cast(int, _get(sock, _EVENTS))
