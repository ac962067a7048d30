"""Who may use the gateway: API keys (given, or one per line in a file), TLS files, and the rule that a
gateway reachable from the network has a key unless the user said ``--insecure`` (the same rule as CURVE on
the ZeroMQ front). Checked at start, before anything listens.

    --api-key KEY, --api-key-file FILE ──▶ load_keys (the file: this user's or root's, closed to others) ──▶
                                           app's key middleware (constant-time compare)

    --http HOST, keys, --insecure       ──▶ check_exposure (ConfigError: refused at start)
    --ssl-certfile, --ssl-keyfile       ──▶ check_tls ──▶ uvicorn (https)
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from pathlib import Path

from mpserve.errors import ConfigError
from mpserve.private import read_guarded

log = logging.getLogger("mpserve.gateway")


def load_keys(key: str | None, key_file: str | None) -> tuple[str, ...]:
    """The key given and those of the file: one per line; blank lines and lines starting with # skipped. A file
    other users may read or write is refused (``private.read_guarded``)."""
    keys = [key] if key else []
    if key_file is not None:
        try:
            lines = read_guarded(key_file, "API key file", secret=True).decode().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--api-key-file: cannot read {key_file}: {exc}") from None
        found = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not found:
            raise ConfigError(f"--api-key-file: {key_file} holds no key (one per line)")
        keys += found
    return tuple(keys)


class KeyRing:
    """The API keys a gateway takes, as ``Authorization`` carries them: the key given and those of
    ``--api-key-file``, read again by ``reload`` (SIGHUP: ``mpserve reload`` sends it to the gateways it runs). A
    file that cannot be read, or holds no key, is logged and the keys in use stay."""

    def __init__(self, key: str | None, key_file: str | None, keys: tuple[str, ...]) -> None:
        self._key, self._file = key, key_file
        self.expected = _bearer(keys)

    def reload(self) -> None:
        if self._file is None:
            return
        try:
            keys = load_keys(self._key, self._file)
        except ConfigError as exc:
            log.error("API keys not read again, the keys in use stay: %s", exc.message)
            return
        self.expected = _bearer(keys)
        log.info("API keys read again from %s: %d key(s)", self._file, len(keys))


def _bearer(keys: tuple[str, ...]) -> tuple[bytes, ...]:
    return tuple(f"Bearer {key}".encode() for key in keys)


def any_matches(given: bytes, expected: tuple[bytes, ...]) -> bool:
    """Whether ``given`` equals one of ``expected``; every one is compared, each in constant time."""
    matched = False
    for candidate in expected:
        matched |= hmac.compare_digest(given, candidate)
    return matched


def check_exposure(host: str, keys: tuple[str, ...], insecure: bool) -> None:
    if not keys and not insecure and not loopback(host):
        raise ConfigError(f"--http {host} is reachable from the network and has no API key: set --api-key (or "
                          "MPSERVE_API_KEY) or --api-key-file, listen on 127.0.0.1, or pass --insecure to let "
                          "anyone who can reach the port use the models")


def check_tls(certfile: str | None, keyfile: str | None) -> None:
    if (certfile is None) != (keyfile is None):
        raise ConfigError("TLS needs both --ssl-certfile (the certificate chain, PEM) and --ssl-keyfile (its "
                          "private key, PEM)")
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"{flag}: no such file {path}")


def loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
