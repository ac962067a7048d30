"""What ``mpserve start`` checks before anything starts: every address it binds and every folder it writes.

    config, --http ──▶ check_start
                         ├─ refuse_live      a live server of the same name refuses (``serve``'s ``claim``
                         │                    then removes, and logs, what a dead one left)
                         ├─ the children      they import this server's mpserve (``children.check_importable``)
                         ├─ the ZeroMQ binds  each bound once with a plain socket that never listens, then
                         │                    closed: in use, no scheme, no permission, no folder, too long
                         ├─ the HTTP port     bound once and closed, as uvicorn binds it
                         ├─ the lock folder   a file made and removed in it, when it is given or permits are used
                         ├─ the store folder  each model's host store RAM tier: made 0700, or refused unless it is
                         │                    this user's alone (``mpserve.private``)
                         └─ the adapters      each LoRA adapter's GGUF header against its model's (those on the Hub
                                              once pulled, by ``config.pull_sources``)

A failure is a ``ConfigError``: one line naming the address or path, what is wrong and the fix, raised before
the slot table, the sockets, the gateway or any worker exists, so a refused start leaves nothing behind. The
model files are checked earlier, by ``config.build``. ``bind_problem`` also words a bind that fails later,
in ``serve``, for an address taken in between.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import tempfile
from pathlib import Path

from mpserve import children
from mpserve.config.loader import ECHO_MODEL, ServerConfig, check_adapters, tier_folder
from mpserve.errors import ConfigError
from mpserve.gpu.permits import LOCK_FOLDER, default_lock_dir
from mpserve.private import check_private_dir, private_dir
from mpserve.runtime import ServerInfo, ServerPaths

log = logging.getLogger("mpserve.server")


def check_start(config: ServerConfig, http: tuple[str, int] | None = None) -> None:
    """Raise ``ConfigError`` for the first address or folder that ``mpserve start`` could not use."""
    paths = ServerPaths.for_name(config.server_name, config.bind, config.workers_bind, config.admin_bind)
    refuse_live(paths)
    children.check_importable()  # the fork server, its zygotes and workers: the mpserve this process runs
    for flag, address in (("--bind", paths.front), ("--workers-bind", paths.back), ("--admin-bind", paths.admin)):
        check_bind(flag, address)
    if http is not None:
        check_http(*http)
    if config.lock_dir is not None or config.permit_capacity is not None:
        check_lock_dir(config.lock_dir)
    for model in config.models:  # the default store folder too: the config checks only the folders it is given
        if model.cache_ram and model.path != ECHO_MODEL:
            private_dir(Path(model.store_dir()), tier_folder("ram"))
        check_adapters(model, pulled=False)  # those on the Hub: once pulled (``pull_sources``)


def refuse_live(paths: ServerPaths) -> None:
    """Refuse to start over a live server of the same name."""
    info = ServerInfo.read(paths.name)
    if info is not None and info.alive() and info.pid != os.getpid():
        raise ConfigError(f"a server named {paths.name!r} is already running (pid {info.pid}, {info.front}); "
                          "stop it first or give this one another --server-name")


def claim(paths: ServerPaths) -> None:
    """Refuse to start over a live server of the same name; remove what a dead one left behind (once logging
    is set up, so that the removal is said)."""
    refuse_live(paths)
    for stale in [paths.info, paths.slots, *paths.ipc_files()]:
        if os.path.lexists(stale):  # a link too, even one to nothing: the slot table is made anew, never through one
            log.info("removing %s left by a server that is no longer running", stale)
            try:
                stale.unlink(missing_ok=True)
            except OSError as exc:  # another user's, in a sticky folder such as /dev/shm
                raise ConfigError(f"cannot remove {stale}, which is in the way of this server's ({exc.strerror}); "
                                  "remove it as its owner or root, or give this server another --server-name") \
                    from None


def check_bind(flag: str, address: str) -> None:
    """Whether ``address`` could be bound, found with a plain socket that is bound and closed, never listening:
    a client reconnecting to a server of this name that is starting again must not meet a throwaway listener,
    which would take its messages (a reattached request, ``mpserve.client``) and drop them as it closes."""
    if address.startswith("ipc://"):
        _check_ipc(flag, address, Path(address[len("ipc://"):]))
    elif address.startswith("tcp://"):
        _check_tcp(flag, address, address[len("tcp://"):])
    else:
        raise ConfigError(f"{flag} {address}: not a ZeroMQ address; give tcp://HOST:PORT (e.g. "
                          "tcp://127.0.0.1:5555) or ipc:///PATH")


def _check_ipc(flag: str, address: str, path: Path) -> None:
    """The ipc path: short enough for a unix socket, nobody listening there (ZeroMQ would take it over), its folder
    one this user can bind in (a socket bound beside it under a name of this process's, and removed)."""
    if len(os.fsencode(path)) > _UNIX_PATH_MAX:
        raise ConfigError(bind_problem(flag, address, errno.ENAMETOOLONG, "path too long"))
    if _listening(path):
        raise ConfigError(f"{flag} {address}: another process listens on this ipc path; stop it or give "
                          "another path")
    beside = path.parent / f".mpserve-check-{os.getpid()}"
    if len(os.fsencode(beside)) > _UNIX_PATH_MAX:
        return  # the bind itself words what fails (``serve``)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(os.fspath(beside))
        except OSError as exc:
            raise ConfigError(bind_problem(flag, address, exc.errno, exc.strerror or str(exc))) from None
        beside.unlink()  # the socket file this bind made


def _check_tcp(flag: str, address: str, where: str) -> None:
    """HOST:PORT bound as ZeroMQ binds it (``*``: every address; ``[v6]``; SO_REUSEADDR), never listening. A port
    ``*`` (any free one) and an interface name are left to the bind itself."""
    host, _, port = where.rpartition(":")
    if port == "*" or _is_interface(host):
        return
    if not host or not port.isdigit():
        raise ConfigError(bind_problem(flag, address, errno.EINVAL, "not HOST:PORT"))
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("" if bare == "*" else bare, int(port)))
        except socket.gaierror:
            raise ConfigError(bind_problem(flag, address, errno.EADDRNOTAVAIL, "unknown host")) from None
        except OSError as exc:
            raise ConfigError(bind_problem(flag, address, exc.errno, exc.strerror or str(exc))) from None


def _is_interface(host: str) -> bool:
    """Whether ``host`` names a network interface (ZeroMQ binds its address)."""
    try:
        socket.if_nametoindex(host)
    except OSError:
        return False
    return True


_UNIX_PATH_MAX = 107  # bytes of a unix socket's path, without its closing NUL
_IN_USE = "the address is in use (another server or program listens there); stop it or give another port"
_NO_PERMISSION = ("no permission to bind it (ports below 1024 need root; an ipc path needs a folder you can write); "
                  "give a port above 1023 or another path")
_NOT_HERE = "the host is not an address of this machine; give one of its addresses, 127.0.0.1, or * for all"
_BIND_FIXES = {
    errno.EADDRINUSE: _IN_USE,
    errno.EACCES: _NO_PERMISSION,
    errno.EPERM: _NO_PERMISSION,
    errno.ENOENT: "its folder does not exist; create it or give another path",
    errno.ENAMETOOLONG: "the ipc path is too long for a socket (107 bytes at most); set MPSERVE_RUNTIME_DIR to a "
                        "shorter folder or give a shorter path",
    errno.EADDRNOTAVAIL: _NOT_HERE,
    errno.ENODEV: _NOT_HERE,
    errno.EPROTONOSUPPORT: "not a ZeroMQ address; give tcp://HOST:PORT or ipc:///PATH",
    errno.EINVAL: "not a valid address; give tcp://HOST:PORT (e.g. tcp://127.0.0.1:5555) or ipc:///PATH",
}


def bind_problem(flag: str, address: str, code: int | None, reason: str) -> str:
    """One line: the address, what ``code`` (an errno) means for it, and the fix."""
    return f"{flag} {address}: cannot bind: {_BIND_FIXES.get(code or 0, reason)}"


def check_http(host: str, port: int) -> None:
    """Bind the gateway's port as uvicorn does (IPv6 for a host with a colon, SO_REUSEADDR) and close it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except socket.gaierror as exc:
            raise ConfigError(f"--http {host}:{port}: cannot resolve {host!r} ({exc.strerror}); give an address "
                              "of this machine, e.g. 127.0.0.1") from None
        except OSError as exc:
            raise ConfigError(bind_problem("--http", f"{host}:{port}", exc.errno, exc.strerror or str(exc))) from None


def check_lock_dir(given: str | None) -> None:
    """The permit lock folder (``--lock-dir``, else the default) exists, is private to this user (0700, ours) and
    takes a new file."""
    path = Path(given) if given is not None else default_lock_dir()
    fix = "give --lock-dir a folder you can write (every server of this host must use the same one)"
    if not path.is_dir():
        raise ConfigError(f"--lock-dir {path}: {'not a folder' if path.exists() else 'no such folder'}; {fix}")
    check_private_dir(path, LOCK_FOLDER)
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigError(f"--lock-dir {path}: cannot write in it ({exc.strerror}); {fix}") from None


def _listening(path: Path) -> bool:
    """Whether a process accepts connections on the unix socket at ``path`` (ZeroMQ would take it over)."""
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(os.fspath(path))
        except OSError:
            return False
    return True
