"""TLS and keys on the HTTP front: ``mpserve start --http`` with a self-signed certificate made here and keys
from a file; the official ``openai`` client over https; plain HTTP to the TLS port gets no HTTP answer; a
network ``--http`` without a key is refused at start."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import ServerProcess
from helpers import free_port, mpserve, wait_for

from mpserve.errors import ConfigError
from mpserve.gateway.http.access import check_exposure, load_keys

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

KEYS = ("first-key", "second-key")


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, ssl.SSLContext]]:
    folder = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(folder)
    keys = folder / "keys"
    keys.write_text(f"# the gateway's keys\n{KEYS[0]}\n\n{KEYS[1]}\n")
    keys.chmod(0o600)  # a key file others may read is refused
    port = free_port()
    server = ServerProcess("--http", f"127.0.0.1:{port}", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                           "--api-key-file", str(keys)).wait_ready()
    trust = ssl.create_default_context(cafile=str(cert))
    url = f"https://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/health", verify=trust, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, 30, "the gateway answers over https")
    yield url, port, trust
    server.stop()
    assert not server.tracebacks(), "\n".join(server.log)


@pytest.mark.timeout(60)
def test_the_openai_client_over_https_with_each_key_from_the_file(tls_server) -> None:
    url, _, trust = tls_server
    for key in KEYS:
        with httpx.Client(verify=trust) as http:
            oc = openai.OpenAI(base_url=f"{url}/v1", api_key=key, http_client=http, max_retries=0, timeout=30)
            done = oc.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0)
            assert done.usage.completion_tokens == 2
    with httpx.Client(verify=trust) as http:
        oc = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", http_client=http, max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError):
            oc.completions.create(model="tiny", prompt="hi", max_tokens=2)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # not trusted: refused
        httpx.get(url + "/health", timeout=5)


@pytest.mark.timeout(60)
def test_plain_http_to_the_tls_port_gets_no_http_answer(tls_server) -> None:
    _, port, _ = tls_server
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = b""
        try:
            while piece := sock.recv(65536):
                answer += piece
        except ConnectionResetError:
            pass
    assert not answer.startswith(b"HTTP"), answer[:200]


@pytest.mark.timeout(60)
def test_a_network_http_without_a_key_is_refused_at_start() -> None:
    run = mpserve("start", "--server-name", "refused", "--http", f"0.0.0.0:{free_port()}", timeout=50)
    assert run.returncode == 1 and "--insecure" in run.stderr and "API key" in run.stderr, run.stderr
    gateway = mpserve("gateway", "--http", f"0.0.0.0:{free_port()}", timeout=50)
    assert gateway.returncode == 1 and "--insecure" in gateway.stderr, gateway.stderr


def test_keys_come_one_per_line_and_an_empty_file_is_refused(tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(" a \n# no\n\nb\n")
    keys.chmod(0o600)
    assert load_keys("k", str(keys)) == ("k", "a", "b")
    keys.write_text("# only a comment\n")
    with pytest.raises(ConfigError, match="holds no key"):
        load_keys(None, str(keys))
    check_exposure("127.0.0.1", (), insecure=False)
    check_exposure("0.0.0.0", (), insecure=True)
    with pytest.raises(ConfigError, match="--insecure"):
        check_exposure("::", (), insecure=False)
