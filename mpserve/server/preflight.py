"""What ``mpserve start`` checks before anything starts: every address it binds and every folder it writes.

    config, --http ──▶ check_start
                         ├─ refuse_live      a live server of the same name refuses (``serve``'s ``claim``
                         │                    then removes, and logs, what a dead one left)
                         ├─ the children      they import this server's mpserve (``children.check_importable``)
                         ├─ the ZeroMQ binds  each bound once with a throwaway socket, then closed (and its
                         │                    ipc file removed): in use, no scheme, no permission, no folder
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

import zmq

from mpserve import children
from mpserve.config.loader import ECHO_MODEL, ServerConfig, check_adapters, tier_folder
from mpserve.errors import ConfigError
from mpserve.gpu.permits import LOCK_FOLDER, default_lock_dir
from mpserve.private import check_private_dir, private_dir
from mpserve.runtime import ServerInfo, ServerPaths

log = logging.getLogger("mpserve.server")

_SCHEMES = ("tcp://", "ipc://")


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
    """Bind ``address`` with a throwaway ZeroMQ socket and close it at once."""
    if not address.startswith(_SCHEMES):
        raise ConfigError(f"{flag} {address}: not a ZeroMQ address; give tcp://HOST:PORT (e.g. "
                          "tcp://127.0.0.1:5555) or ipc:///PATH")
    ipc = Path(address[len("ipc://"):]) if address.startswith("ipc://") else None
    if ipc is not None and _listening(ipc):
        raise ConfigError(f"{flag} {address}: another process listens on this ipc path; stop it or give "
                          "another path")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        raise ConfigError(bind_problem(flag, address, exc.errno, exc.strerror)) from None
    finally:
        sock.close(linger=0)
        ctx.term()
        if ipc is not None:
            ipc.unlink(missing_ok=True)


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
