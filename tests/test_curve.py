"""CURVE on a TCP bind: `mpserve keygen` key pairs, a server that lets in only the clients whose public
keys it holds, and a refusal to open a port to the network without keys. All traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import shutil
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq.auth
from helpers import free_port, mpserve

from mpserve import AsyncClient, Client
from mpserve.errors import ConnectionFailed
from mpserve.runtime import ServerInfo

REFUSED_CONNECT_S = 2.0


def keygen(directory: Path, name: str) -> subprocess.CompletedProcess[str]:
    return mpserve("keygen", str(directory), name)



@dataclass(frozen=True)
class Keys:
    dir: Path
    allowed: Path  # the server's --curve-clients folder

    def public(self, name: str) -> str:
        return str(self.dir / f"{name}.key")

    def secret(self, name: str) -> str:
        return str(self.dir / f"{name}.key_secret")


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    """Key pairs for a server, an allowed client (alice) and a stranger (mallory)."""
    k = Keys(tmp_path / "keys", tmp_path / "allowed")
    for name in ("server", "alice", "mallory"):
        done = keygen(k.dir, name)
        assert done.returncode == 0, done.stderr
    k.allowed.mkdir()
    shutil.copy(k.public("alice"), k.allowed / "alice.key")
    return k


@pytest.mark.timeout(60)
def test_keygen_writes_a_zmq_certificate_pair_and_keeps_the_secret_private(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    done = keygen(directory, "node1")
    assert done.returncode == 0, done.stderr
    public_file, secret_file = directory / "node1.key", directory / "node1.key_secret"
    public, no_secret = zmq.auth.load_certificate(str(public_file))
    public_again, secret = zmq.auth.load_certificate(str(secret_file))
    assert no_secret is None and public == public_again and secret is not None
    assert len(public) == len(secret) == 40  # Z85 of 32 bytes
    assert zmq.curve_public(secret) == public
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(directory.stat().st_mode) & 0o077 == 0

    before = secret_file.read_bytes()
    again = keygen(directory, "node1")
    assert again.returncode == 1 and "exists" in again.stderr
    assert secret_file.read_bytes() == before, "keygen overwrote an existing secret key"


@pytest.mark.timeout(90)
def test_only_clients_whose_public_key_the_server_holds_get_through(start_server, keys: Keys,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    server = start_server("--instances", "1", "--threads", "1", "--bind", address,
                          "--curve-secret", keys.secret("server"), "--curve-clients", str(keys.allowed)).wait_ready()
    assert server.address == address

    refused = {
        "no keys": {},
        "a key the server does not hold": {"curve_server_key": keys.public("server"),
                                           "curve_secret": keys.secret("mallory")},
        "the wrong server key": {"curve_server_key": keys.public("mallory"), "curve_secret": keys.secret("alice")},
    }
    for why, curve in refused.items():
        with pytest.raises(ConnectionFailed):
            Client(address, connect_timeout=REFUSED_CONNECT_S, **curve)
            pytest.fail(f"a client with {why} got through")
    opened = AsyncClient._open

    def refused_before_the_first_ping(self: AsyncClient) -> None:
        """What a loaded host can do: the client's thread held up after it connected while ZeroMQ met the server's
        refusal, which leaves the socket no connection and no room, for good (a ping sent then waits for ever).
        That state made certain: the connection dropped at once."""
        opened(self)
        self._sock.disconnect(self.address)

    monkeypatch.setattr(AsyncClient, "_open", refused_before_the_first_ping)
    with pytest.raises(ConnectionFailed, match="does it accept your CURVE keys"):
        Client(address, connect_timeout=REFUSED_CONNECT_S)
    monkeypatch.undo()
    from test_node_client import run_script
    error = run_script("refused.mjs", address)["error"]  # the Node.js client, held up so, without keys
    assert error["name"] == "ConnectionFailed" and "does it accept your CURVE keys" in error["message"], error

    with Client(address, curve_server_key=keys.public("server"), curve_secret=keys.secret("alice"),
                timeout=30) as client:
        result = client.generate("secret handshake", max_tokens=8, temperature=0)
        stream = client.stream("secret handshake", max_tokens=8, temperature=0)
        streamed = "".join(stream)
    assert result.usage.completion_tokens == 8 and streamed == result.text
    assert server.proc.poll() is None
    assert not server.tracebacks(), "\n".join(server.log)


@pytest.mark.timeout(60)
def test_binding_every_interface_without_keys_or_insecure_is_refused_at_start() -> None:
    name = "curve-refused"
    done = mpserve("start", "--server-name", name, "--bind", f"tcp://0.0.0.0:{free_port()}")
    assert done.returncode == 1, done.stdout + done.stderr
    message = done.stderr
    assert "--curve-secret" in message and "--insecure" in message, message
    assert "Traceback" not in message
    assert ServerInfo.read(name) is None, "a refused server published itself"


@pytest.mark.timeout(60)
def test_a_client_whose_key_the_restarted_server_refuses_fails_connection_within_its_reattach_bound(
        start_server, keys: Keys, tmp_path: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    args = ("--instances", "1", "--threads", "1", "--bind", address, "--curve-secret", keys.secret("server"))
    server = start_server(*args, "--curve-clients", str(keys.allowed)).wait_ready()
    nobody = tmp_path / "nobody"  # the next start holds no client key: alice is refused from then on
    nobody.mkdir()
    with Client(address, curve_server_key=keys.public("server"), curve_secret=keys.secret("alice"), timeout=60,
                reattach=4.0) as client:
        pieces = iter(client.stream("a long story", max_tokens=100_000, temperature=0))
        next(pieces)
        server.proc.kill()
        server.proc.wait(10)
        start_server(*args, "--curve-clients", str(nobody), name=server.name).wait_ready()
        began = time.monotonic()
        with pytest.raises(ConnectionFailed):
            for _ in pieces:
                pass
        assert time.monotonic() - began < 4.0 + 10.0  # the bound, and the silence that tells the server gone
