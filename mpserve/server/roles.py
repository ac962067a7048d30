"""Who may do what on the ZeroMQ side: a message's role is the socket it arrived on.

    clients ───▶ front ROUTER (--bind; with CURVE, --curve-clients keys) ──┐ REQUEST CANCEL PING TOKENIZE
                                                                          │ EMBED STATS_QUERY
    operators ─▶ admin ROUTER (--admin-bind) ─────────────────────────────┤ all of those, and CONTROL and
                   ipc (the default): the socket file is mode 0600, in     │ SLOT_ACTION (``ADMIN_ONLY``)
                   the runtime folder (0700): this user alone              ▼
                   tcp: CURVE, only keys in --curve-admins        Clients.message(frames, tenant, admin)
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

The gateways of ``start --http`` reach a CURVE front with a key pair of their own, in the runtime folder:

    start ──▶ gateway_keys: NAME.gateway.key_secret and NAME.gateway.key both left (the server before this one
              died or upgraded; its gateways run on, holding that key, and reattach to this start)
                 ──▶ kept once each half is a regular file of this user's, the secret one closed to others, one
                     pair in both; else ConfigError (a planted key is never let in)
              else ──▶ a fresh pair, written through create_private
          ──▶ allow: the front and the admin socket accept it ──▶ a clean stop removes it (remove_gateway_keys)
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.base import Authenticator

from mpserve.errors import ConfigError, Forbidden
from mpserve.private import create_private, open_private
from mpserve.runtime import ServerPaths
from mpserve.wire import protocol as wire

ADMIN_ONLY = frozenset({wire.MsgType.CONTROL, wire.MsgType.SLOT_ACTION, wire.MsgType.ADAPTER_ACTION})
ADMIN_TAG = b"\x00admin:"
KEY_FILE_MAX = 4096  # a key file holds a few hundred bytes: what lies past this is not read


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
    """The CURVE key pair of the gateways ``start --http`` runs, in the runtime folder; the server accepts it
    (``allow``) beside the configured keys, so its own gateways reach a CURVE front without a key the user must make.
    Where the server before this one left both halves (it died, or upgraded), its gateways run on holding that key and
    reattach to this start: the pair is kept, once checked (``ConfigError`` if it fails, as a planted key must never be
    let in). Otherwise a fresh pair, written through ``create_private``. Returns the secret half's file."""
    secret, public = _halves(paths)
    if os.path.lexists(secret) and os.path.lexists(public):
        _check_kept(secret, public)
        return secret
    for half in (secret, public):
        half.unlink(missing_ok=True)
    public_key, secret_key = zmq.curve_keypair()
    _write(secret, public_key, secret_key)
    _write(public, public_key, None)  # last: where both halves are, the secret one is whole
    return secret


def remove_gateway_keys(paths: ServerPaths) -> None:
    """A clean stop: no gateway is left to reattach with the pair."""
    for half in _halves(paths):
        half.unlink(missing_ok=True)


def _halves(paths: ServerPaths) -> tuple[Path, Path]:
    """The gateways' key files: the secret half, and the public half beside it (without "_secret")."""
    return paths.gateway_key, paths.gateway_key.with_suffix(".key")


def _write(path: Path, public: bytes, secret: bytes | None) -> None:
    """A ZeroMQ certificate file, as ``zmq.auth.load_certificate`` reads one: the public key, and the secret one if
    given; created 0600, never through a name that is there."""
    lines = ["# mpserve start --http: its gateways' CURVE key", "curve", f'    public-key = "{public.decode()}"',
             *([f'    secret-key = "{secret.decode()}"'] if secret is not None else [])]
    try:
        fd = create_private(path, os.O_WRONLY)
    except OSError as exc:
        raise ConfigError(f"cannot create the gateways' CURVE key file {path} ({exc.strerror}); remove what is "
                          f"there (rm {path}) and start again") from None
    with os.fdopen(fd, "w") as file:
        file.write("\n".join(lines) + "\n")


def _check_kept(secret: Path, public: Path) -> None:
    """Refuse (``ConfigError``) the pair the server before this one left unless both halves are regular files of
    this user's (not links), the secret one closed to other users, holding one key pair."""
    try:
        secret_fields, public_fields = _fields(secret, closed=True), _fields(public, closed=False)
        if "secret-key" not in secret_fields:
            raise ValueError(f"{secret} holds no secret key")
        if not (zmq.curve_public(secret_fields["secret-key"]) == secret_fields.get("public-key")
                == public_fields.get("public-key")):
            raise ValueError(f"{secret} and {public} are not one key pair")
    except (OSError, ValueError) as exc:  # OSError: PlantedFile among them; ValueError: the mode, text or keys
        raise ConfigError(f"the gateways' CURVE key pair left by the server before this one cannot be used "
                          f"({getattr(exc, 'strerror', None) or exc}): remove it (rm {secret} {public}) and start "
                          "again; a new pair is made, and the gateways of that server, if they run on, cannot "
                          "reattach") from None


def _fields(path: Path, closed: bool) -> dict[str, bytes]:
    """The keys (public-key, secret-key: Z85) in the ZeroMQ certificate ``path``, a regular file of this user's
    read without following a link; with ``closed``, ValueError if other users may read or write it (its secret
    may be theirs)."""
    with os.fdopen(open_private(path), "rb") as file:
        mode = stat.S_IMODE(os.fstat(file.fileno()).st_mode)
        if closed and mode & 0o077:
            raise ValueError(f"{path} is open to other users (mode {mode:04o})")
        text = file.read(KEY_FILE_MAX).decode()
    lines = (line.partition("=") for line in text.splitlines())
    return {name.strip(): value.strip(" \t'\"").encode() for name, equals, value in lines if equals}


def allow(authenticator: Authenticator, key_file: Path, domains: tuple[str, ...]) -> None:
    """Let the CURVE key of ``key_file`` in to the sockets of ``domains``, beside the folders configured there."""
    public, _ = zmq.auth.load_certificate(key_file)
    for domain in domains:
        authenticator.certs.setdefault(domain, {})[public] = True
