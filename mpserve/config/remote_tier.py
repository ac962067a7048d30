"""The host store's remote tier as configured: a Redis or Valkey address, checked when the configuration is read,
and where its password comes from (``mpserve.engine.remote_store`` uses it).

    cache_remote ("redis://[USER@]HOST:PORT/DB", "rediss://…" with TLS) ─┐
    cache_remote_ttl, cache_remote_size                                  ├─▶ check_url ─▶ RemoteTier ─▶ the worker's
    cache_remote_password_file, or MPSERVE_CACHE_REMOTE_PASSWORD ────────┘   (ConfigError)              EngineSpec

A password never travels in the address: the address is a flag, shown by ``ps`` and written into logs, so one
that holds a password is refused. An ACL user may be named in it (``redis://USER@HOST``); the password is read by
the worker when it connects, from the file named by ``cache_remote_password_file`` or from the variable
``MPSERVE_CACHE_REMOTE_PASSWORD``.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from mpserve.errors import ConfigError
from mpserve.private import read_guarded

SCHEMES = ("redis", "rediss")
PASSWORD_ENV = "MPSERVE_CACHE_REMOTE_PASSWORD"


@dataclass(frozen=True)
class RemoteTier:
    url: str  # redis://[USER@]HOST:PORT/DB or rediss://…, never with a password
    ttl_s: int  # each entry expires this long after it was written
    entry_bytes: int  # the largest entry written or read
    password_file: str | None = None  # the password's file; None: MPSERVE_CACHE_REMOTE_PASSWORD, if set


def check_url(value: str, where: str) -> str:
    """``value`` if it is a Redis address mpserve may use, else a ConfigError naming ``where`` and the fix."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"{where}: {value!r} is not an address ({exc})") from None
    if parts.scheme not in SCHEMES or not parts.hostname:
        raise ConfigError(f"{where}: {value!r} is not a Redis address; give redis://HOST:PORT/DB, or rediss://… "
                          "for TLS")
    if parts.password is not None:
        raise ConfigError(f"{where}: the address holds a password, which a command line and the logs would show; "
                          f"put it in a file named by cache_remote_password_file, or in {PASSWORD_ENV}, and give "
                          f"the address without it")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ConfigError(f"{where}: the database in {value!r} is not a number (redis://HOST:PORT/DB)")
    if port is None:
        raise ConfigError(f"{where}: {value!r} names no port (redis://HOST:PORT/DB; Redis listens on 6379)")
    return value


def read_password(path: str) -> str | None:
    """The first line of the password file at ``path`` (None if it is empty): a file of this user's or root's that
    nobody else may read or write (``ConfigError`` otherwise), as every secret's."""
    lines = read_guarded(path, "remote store password file", secret=True).decode().splitlines()
    return lines[0] if lines and lines[0] else None


def check_password_file(path: str, where: str) -> None:
    """A ConfigError naming ``where`` unless the password file at ``path`` can be read and is guarded."""
    try:
        read_password(path)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {path} ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: {path} is not text") from None
