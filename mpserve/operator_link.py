"""How an operator command (``mpserve status``, ``models``, ``load``, ``slots``, ``adapters``, ``upgrade``, …) reaches
a running server: which server, the CURVE keys for a tcp one, and a connected client.

    Operator(server_name, Curve) ──broker()──▶ the server's description (ServerInfo), or no_server naming those
                                               that run here
                                 ──next_start(info, wait)──▶ an upgrade: the next start's description once its
                                               admin socket answers, or an error naming how far it got
        ──admin_client(info, curve)──▶ a Client on its admin socket (ipc: this user alone, no keys; tcp: the
                                       operator's CURVE keys)
        ──broker_stats(info, curve)──▶ its STATS on the clients' socket, or None said on stderr

A CURVE server drops a client without the right keys silently: a server that does not answer gets an error naming
the keys' flags and variables.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpserve.errors import ConnectionFailed, MpserveError
from mpserve.runtime import ServerInfo
from mpserve.status_text import no_server

if TYPE_CHECKING:
    from mpserve.client import Client
    from mpserve.wire.protocol import Stats


@dataclass(frozen=True)
class Curve:
    """The CURVE keys an operator command talks to a tcp server with (files; None: not given)."""

    server_key: str | None
    secret: str | None


@dataclass(frozen=True)
class Operator:
    """What every command that talks to a running server is told: which server, and the CURVE keys for a tcp one
    (declared once as options: ``cli.operator_options``)."""

    server_name: str
    curve: Curve

    def broker(self) -> ServerInfo:
        """The running server's description; no_server, naming those that run, if it is not running here."""
        info = ServerInfo.read(self.server_name)
        if info is None or not info.alive() or info.role != "broker":
            raise no_server(self.server_name)
        return info

    def next_start(self, old: ServerInfo, wait: float) -> ServerInfo:
        """The info of the start after ``old``'s, once its admin socket answers; ConnectionFailed after ``wait`` s,
        naming how far it got (the old start still running, the process gone, the new one silent)."""
        deadline = time.monotonic() + wait
        stage = "the server had not ended its old start (its instances not handed off yet)"
        while time.monotonic() < deadline:
            if not old.alive():  # the pid stays across the exec: gone, or a zombie, it has ended
                stage = "its process exited"
                break
            new = ServerInfo.read(self.server_name)
            if new is not None and new.started != old.started:
                try:
                    with admin_client(new, self.curve, connect_timeout=2.0) as client:
                        client.stats()
                    return new
                except MpserveError as exc:
                    stage = f"the new start wrote its info but its admin socket did not answer ({exc.message})"
            elif new is None:
                stage = "the old start ended, and the new one has not written its info yet"
            time.sleep(0.2)
        raise ConnectionFailed(f"server {self.server_name!r} (pid {old.pid}) did not come back within {wait:g} s "
                               f"after the hand-off: {stage}; see its log")


def admin_client(info: ServerInfo, curve: Curve, connect_timeout: float | None = None
                 ) -> contextlib.AbstractContextManager[Client]:
    """A client on the server's admin socket: ipc (this user alone) needs no keys; a tcp one takes an operator's
    CURVE keys (--curve-server-key, --curve-secret or their variables), as `generate` takes a client's."""
    address = info.admin or info.front  # a server older than the admin socket takes operator's calls on its front
    return connected(address, curve if address.startswith("tcp://") else Curve(None, None), connect_timeout)


@contextlib.contextmanager
def connected(address: str, curve: Curve, connect_timeout: float | None = None) -> Iterator[Client]:
    """A client of ``address``, connected; a server that does not answer gets an error naming the CURVE keys'
    flags and variables (a CURVE server drops a client without the right keys, silently)."""
    from mpserve.client import CONNECT_TIMEOUT_S, Client

    try:
        client = Client(address, curve_server_key=curve.server_key, curve_secret=curve.secret,
                        connect_timeout=connect_timeout or CONNECT_TIMEOUT_S)
    except ConnectionFailed as exc:
        if address.startswith("tcp://") or os.path.exists(address.removeprefix("ipc://")):  # it did not answer
            given = "the keys given" if curve.server_key and curve.secret else "no keys"
            raise ConnectionFailed(f"{exc.message}; a server with CURVE keys drops a client without its keys "
                                   f"({given} here): give --curve-server-key (MPSERVE_CURVE_SERVER_KEY), the "
                                   "server's public key file, and --curve-secret (MPSERVE_CURVE_CLIENT_SECRET), "
                                   "your secret key file, whose public half the server allows") from None
        raise
    with client:
        yield client


def broker_stats(info: ServerInfo, curve: Curve) -> Stats | None:
    """The broker's STATS (its remote workers, its models' scaling), or None, said on stderr, if it does not
    answer within a second. A broker with CURVE keys is asked with ``curve``, as `generate` asks it."""
    try:
        with connected(info.front, curve, connect_timeout=1.0) as client:
            return client.stats(timeout=1.0)
    except MpserveError as exc:
        print(f"note: remote pools and scaling not shown: {exc.message}", file=sys.stderr)
        return None
