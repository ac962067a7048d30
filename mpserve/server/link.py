"""The worker link's trust rules: which READY is one of the server's own workers, which name it may take, and
whether a worker's answer belongs to the request it names. Pure functions; the broker applies them.

    READY ──▶ local_index: a name w0, w1, … AND no host AND the start's secret ─▶ a local worker (its index)
          │               anything else ─▶ a remote one, whatever name it gives
          └▶ refusal: an unproven READY under a local worker's name (w0, w1, …), a READY whose worker is not its
                      connection's routing name, or any READY under the name of a live local worker from another
                      process ─▶ ERROR ``protocol`` to it, counted, not registered
    FAILED from a peer not registered ─▶ local_index's test (a local name and the start's secret): the load
                      failure of that local worker; anything else is dropped (``Broker``)
    DONE, ERROR ─▶ foreign: a body that does not decode, or answers another request id ─▶ the request ends with
    CHUNK            ERROR ``internal`` at once (the client would drop it and wait for its timeout), counted

The secret (``new_secret``) is made by the broker at each start (an instance adopted from a server that died keeps
showing the secret of the start that made it: ``mpserve.server.adoption``) and travels to the workers the supervisor
starts inside their WorkerSpec (pickled through the fork server or a zygote's pipe, never on a command line
or in the environment), so a process that dials the worker socket cannot learn it. The worker socket does
not let a second connection take a connected worker's routing name (no ``ROUTER_HANDOVER``), so such a
process cannot take a live worker's messages either; a worker whose connection was refused so (its old one
still open) reconnects when the broker stays silent (``mpserve.worker.loop``).
"""

from __future__ import annotations

import hmac
import secrets

import msgspec

from mpserve.errors import MpserveError
from mpserve.wire import protocol as wire

from .state import WorkerEntry


def new_secret() -> str:
    return secrets.token_urlsafe(24)


def local_index(identity: bytes, msg: wire.Ready | wire.Failed, secrets: tuple[str, ...]) -> int | None:
    """The index of the server's own worker that sent ``msg``, or None for a remote one (or an impostor).
    ``secrets``: this start's, then those of the instances it adopts (``mpserve.server.adoption``)."""
    host = msg.host if isinstance(msg, wire.Ready) else ""
    proof = msg.proof.encode()
    if (not _local_name(identity) or host
            or not any([hmac.compare_digest(proof, secret.encode()) for secret in secrets])):
        return None
    return int(identity[1:])


def refusal(identity: bytes, msg: wire.Ready, index: int | None, old: WorkerEntry | None) -> str | None:
    """Why ``msg`` may not register under ``identity`` (None: it may)."""
    if index is None and _local_name(identity):
        return ("the names w0, w1, … belong to the server's own workers, and this READY does not prove it is one "
                "of them; a remote pool's workers register as HOST-PID-wN (`mpserve worker --connect`)")
    if identity != msg.worker.encode():
        return (f"its READY names worker {msg.worker!r}, its connection {identity!r}: a worker registers under its "
                "connection's routing name")
    if old is not None and old.index is not None and old.pid != msg.pid:
        return f"worker {identity.decode()} (pid {old.pid}) is alive under this name"
    return None


class _Answer(msgspec.Struct):
    id: str | None


_ANSWER = msgspec.msgpack.Decoder(_Answer)


def foreign(mtype: wire.MsgType, body: bytes, rid: str) -> str | None:
    """Why a worker's DONE, ERROR or CHUNK ``body`` cannot go to the client of request ``rid`` (None: it can).
    A terminal body is decoded whole (the client decodes it once); a CHUNK only as far as its id."""
    try:
        got = wire.decode_body(mtype, body).id if mtype is not wire.MsgType.CHUNK else _ANSWER.decode(body).id
    except (MpserveError, msgspec.MsgspecError, ValueError, TypeError) as exc:
        return f"a malformed {mtype.name} ({exc})"
    if got != rid:
        return f"a {mtype.name} for request id {got!r}, not {rid!r}"
    return None


def _local_name(identity: bytes) -> bool:
    return identity[:1] == b"w" and identity[1:].isdigit()
