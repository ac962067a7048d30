"""The roles' rules (mpserve.server.roles) on their own: which calls only the admin socket takes, how an operator's
key differs from a client's, the admin socket's file and the gateway's own CURVE key. tests/test_roles.py proves
the same on a running server; these fail on a one-line change to any rule."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zmq
import zmq.auth
from zmq.auth.base import Authenticator

from mpserve.errors import ConfigError, Forbidden
from mpserve.runtime import ServerPaths
from mpserve.server import roles
from mpserve.wire import protocol as wire

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("mtype", list(wire.MsgType))
def test_only_control_slot_and_adapter_actions_need_the_admin_socket(mtype: wire.MsgType) -> None:
    roles.check(mtype, admin=True)  # an operator may send anything
    if mtype not in (wire.MsgType.CONTROL, wire.MsgType.SLOT_ACTION, wire.MsgType.ADAPTER_ACTION):
        roles.check(mtype, admin=False)
        return
    with pytest.raises(Forbidden) as refused:
        roles.check(mtype, admin=False)
    assert refused.value.message == (
        f"{mtype.name} is an operator's call, and this is the clients' socket: send it to the server's admin socket "
        "(admin_bind; `mpserve models`, `load`, `unload`, `scale`, `add`, `slots` and `adapters` use it), over CURVE "
        "with a key "
        "in the server's curve_admins folder")


def test_an_operators_key_is_its_routing_id_behind_a_tag_no_client_can_have() -> None:
    client = b"\x00k\x8b\x45\x67"  # a routing id ZeroMQ made: a zero byte and 4 more
    operator = roles.admin_client(client)
    assert operator == b"\x00admin:" + client
    assert roles.is_admin(operator) and not roles.is_admin(client)
    assert not roles.is_admin(b"x\x00admin:")  # the tag counts only at the start
    assert roles.routing_id(operator) == client and roles.routing_id(client) == client
    assert roles.routing_id(b"\x00admin") == b"\x00admin"  # shorter than the tag: a client's id as it is


def test_an_ipc_admin_socket_is_closed_to_every_other_user_and_a_tcp_one_is_left_to_curve(tmp_path: Path) -> None:
    sock = tmp_path / "s.admin.sock"
    sock.write_bytes(b"")
    sock.chmod(0o666)
    roles.owner_only(f"ipc://{sock}")
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    roles.owner_only(f"tcp://127.0.0.1:1/{sock}")  # not a file: nothing to change (and nothing is touched)
    sock.chmod(0o644)
    roles.owner_only(f"tcp://{sock}")
    assert stat.S_IMODE(sock.stat().st_mode) == 0o644


def paths(folder: Path) -> ServerPaths:
    return ServerPaths("srv", "ipc://f", "ipc://b", folder / "srv.json", folder / "srv.slots",
                       gateway_key=folder / "srv.gateway.key_secret")


def test_the_gateways_key_pair_is_fresh_its_secret_half_private_and_a_lone_planted_link_is_not_followed(
        tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("not yours\n")
    for lone in ("srv.gateway.key_secret", "srv.gateway.key"):  # one half only: no pair was left, a fresh one is made
        (tmp_path / lone).symlink_to(target)
        secret = roles.gateway_keys(paths(tmp_path))
        assert secret == tmp_path / "srv.gateway.key_secret"
        assert target.read_text() == "not yours\n"  # the link was removed, not written through
        public_file = tmp_path / "srv.gateway.key"
        for half in (secret, public_file):
            assert not half.is_symlink() and half.is_file()
        assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
        public, secret_key = zmq.auth.load_certificate(secret)
        assert secret_key is not None and zmq.curve_public(secret_key) == public
        assert zmq.auth.load_certificate(public_file) == (public, None)
        roles.remove_gateway_keys(paths(tmp_path))
        assert not secret.exists() and not public_file.exists()


def test_the_pair_a_server_left_is_kept_for_its_gateways_and_a_clean_stop_ends_it(tmp_path: Path) -> None:
    """The server before this one died or upgraded: its gateways hold the pair, the next start keeps it (a public
    half open to others is no secret); after a clean stop the next start makes a new one."""
    secret = roles.gateway_keys(paths(tmp_path))
    kept = secret.read_bytes()
    (tmp_path / "srv.gateway.key").chmod(0o644)
    assert roles.gateway_keys(paths(tmp_path)) == secret and secret.read_bytes() == kept
    roles.remove_gateway_keys(paths(tmp_path))
    assert roles.gateway_keys(paths(tmp_path)) == secret and secret.read_bytes() != kept


def _link_to_a_copy(half: Path) -> None:
    copy = half.with_name("copy")
    copy.write_bytes(half.read_bytes())
    copy.chmod(0o600)
    half.unlink()
    half.symlink_to(copy)


def _another_pair(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    roles.gateway_keys(paths(other))
    (tmp_path / "srv.gateway.key").write_bytes((other / "srv.gateway.key").read_bytes())


PLANTED = {
    "the secret half a link": lambda d: _link_to_a_copy(d / "srv.gateway.key_secret"),
    "the public half a link": lambda d: _link_to_a_copy(d / "srv.gateway.key"),
    "the secret half open to others": lambda d: (d / "srv.gateway.key_secret").chmod(0o644),
    "the secret half a folder": lambda d: ((d / "srv.gateway.key_secret").unlink(),
                                           (d / "srv.gateway.key_secret").mkdir()),
    "the public half of another pair": _another_pair,
    "no secret key": lambda d: (d / "srv.gateway.key_secret").write_bytes((d / "srv.gateway.key").read_bytes()),
    "no key at all": lambda d: (d / "srv.gateway.key").write_text("curve\n    public-key\n"),
    "not a key": lambda d: (d / "srv.gateway.key").write_text('public-key = "short"\n'),
}


@pytest.mark.parametrize("planted", list(PLANTED))
def test_a_left_pair_that_is_not_this_users_own_private_one_is_refused_never_let_in(tmp_path: Path,
                                                                                   planted: str) -> None:
    secret = roles.gateway_keys(paths(tmp_path))
    public = tmp_path / "srv.gateway.key"
    PLANTED[planted](tmp_path)
    before = {half: half.read_bytes() for half in (secret, public) if half.is_file()}
    with pytest.raises(ConfigError) as refused:
        roles.gateway_keys(paths(tmp_path))
    assert f"remove it (rm {secret} {public}) and start again" in refused.value.message
    assert {half: half.read_bytes() for half in (secret, public) if half.is_file()} == before  # nor replaced


def test_a_left_pair_of_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    roles.gateway_keys(paths(tmp_path))
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)  # the files are now another user's
    with pytest.raises(ConfigError, match="is not a regular file of yours"):
        roles.gateway_keys(paths(tmp_path))


def test_the_gateways_key_is_let_in_to_the_domains_named_beside_the_keys_there(tmp_path: Path) -> None:
    secret = roles.gateway_keys(paths(tmp_path))
    public, _ = zmq.auth.load_certificate(secret)
    with zmq.Context() as ctx:
        auth = Authenticator(ctx)
        auth.certs["front"] = {b"another client key": True}
        roles.allow(auth, secret, ("front", "admin"))
        assert auth.certs == {"front": {b"another client key": True, public: True}, "admin": {public: True}}
