"""Who may do what on the ZeroMQ side: a message's role is the socket it arrived on.

    clients ───▶ front ROUTER (--bind; with CURVE, --curve-clients keys) ──┐ REQUEST CANCEL PING TOKENIZE
                                                                          │ EMBED STATS_QUERY
    operators ─▶ admin ROUTER (--admin-bind) ─────────────────────────────┤ all of those, and CONTROL and
                   ipc (the default): the socket file is mode 0600, in     │ SLOT_ACTION (``ADMIN_ONLY``)
                   the runtime folder (0700): this user alone              ▼
                   tcp: CURVE, only keys in --curve-admins        Broker._from_client(client, frames, admin)
                                                                          │ an operator's call on the front:
                                                                          ▼ ERROR ``forbidden``

Why a socket of its own rather than a list of keys checked per message: the role then holds on ipc, where
there are no keys (as PostgreSQL's peer authentication and Redis's unix socket permissions rest on the file's
owner), and the front's per-message path stays as it is. Over CURVE the two ROUTERs have their own ZAP
domains: a client key opens the front only, an admin key the admin socket only (an operator who also
generates there may).

The broker keys its clients by their routing id; an operator's is ``ADMIN_TAG`` + its routing id on the admin
socket, which no front client can take: ZeroMQ reserves routing ids that start with a zero byte to those it
makes itself, and those are 5 bytes long.
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq.auth
from zmq.auth.base import Authenticator

from mpserve.errors import Forbidden
from mpserve.runtime import ServerPaths
from mpserve.wire import protocol as wire

ADMIN_ONLY = frozenset({wire.MsgType.CONTROL, wire.MsgType.SLOT_ACTION, wire.MsgType.ADAPTER_ACTION})
ADMIN_TAG = b"\x00admin:"


def admin_client(identity: bytes) -> bytes:
    """The broker's key for the operator at routing id ``identity`` of the admin socket."""
    return ADMIN_TAG + identity


def is_admin(client: bytes) -> bool:
    return client.startswith(ADMIN_TAG)


def routing_id(client: bytes) -> bytes:
    """The routing id on its own socket of the client the broker knows as ``client``."""
    return client[len(ADMIN_TAG):] if client.startswith(ADMIN_TAG) else client


def check(mtype: wire.MsgType, admin: bool) -> None:
    """Refuse an operator's call that did not come through the admin socket."""
    if mtype in ADMIN_ONLY and not admin:
        raise Forbidden(f"{mtype.name} is an operator's call, and this is the clients' socket: send it to the "
                        "server's admin socket (admin_bind; `mpserve models`, `load`, `unload`, `scale`, `add`, "
                        "`slots` and `adapters` use it), over CURVE with a key in the server's curve_admins folder")


def owner_only(address: str) -> None:
    """Close an ipc admin socket to every user but this one (its folder, the runtime folder, is 0700 too)."""
    if address.startswith("ipc://"):
        os.chmod(Path(address[len("ipc://"):]), 0o600)


def gateway_keys(paths: ServerPaths) -> Path:
    """A fresh CURVE key pair for the gateway ``start --http`` runs, in the runtime folder (the secret half mode
    0600); the server accepts it (``allow``) beside the configured keys, so its own gateway reaches a CURVE
    front without a key the user must make. Returns the secret half's file."""
    folder, stem = paths.gateway_key.parent, paths.gateway_key.name.removesuffix(".key_secret")
    for old in (paths.gateway_key, folder / f"{stem}.key"):
        old.unlink(missing_ok=True)
    _, secret = zmq.auth.create_certificates(folder, stem)
    os.chmod(secret, 0o600)
    return Path(secret)


def allow(authenticator: Authenticator, key_file: Path, domains: tuple[str, ...]) -> None:
    """Let the CURVE key of ``key_file`` in to the sockets of ``domains``, beside the folders configured there."""
    public, _ = zmq.auth.load_certificate(key_file)
    for domain in domains:
        authenticator.certs.setdefault(domain, {})[public] = True
