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

from mpserve.errors import Forbidden
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


def test_the_gateways_key_pair_is_fresh_its_secret_half_private_and_planted_links_are_not_followed(
        tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("not yours\n")
    (tmp_path / "srv.gateway.key_secret").symlink_to(target)
    (tmp_path / "srv.gateway.key").symlink_to(target)
    secret = roles.gateway_keys(paths(tmp_path))
    assert secret == tmp_path / "srv.gateway.key_secret"
    assert target.read_text() == "not yours\n"  # the links were removed, not written through
    public_file = tmp_path / "srv.gateway.key"
    for half in (secret, public_file):
        assert not half.is_symlink() and half.is_file()
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    public, secret_key = zmq.auth.load_certificate(secret)
    assert secret_key is not None and zmq.auth.load_certificate(public_file) == (public, None)
    assert roles.gateway_keys(paths(tmp_path)) == secret  # again, with no link: a new pair in place of the old
    assert zmq.auth.load_certificate(secret)[0] != public


def test_the_gateways_key_is_let_in_to_the_domains_named_beside_the_keys_there(tmp_path: Path) -> None:
    secret = roles.gateway_keys(paths(tmp_path))
    public, _ = zmq.auth.load_certificate(secret)
    with zmq.Context() as ctx:
        auth = Authenticator(ctx)
        auth.certs["front"] = {b"another client key": True}
        roles.allow(auth, secret, ("front", "admin"))
        assert auth.certs == {"front": {b"another client key": True, public: True}, "admin": {public: True}}
