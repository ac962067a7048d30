"""Where a running server keeps its sockets and its description, and how other processes find it.

A server is known by its name (``--server-name``, default "default"). Its files:

    $RUNTIME/NAME.sock            the client (front) ipc socket, unless --bind gives another address
    $RUNTIME/NAME.workers.sock    the worker (back) ipc socket
    $RUNTIME/NAME.admin.sock      the operators' ipc socket (mode 0600), unless --admin-bind gives another
    $RUNTIME/NAME.gateway.key*    the CURVE key pair of the gateway ``start --http`` runs (a CURVE --bind)
    $RUNTIME/NAME.json            ServerInfo: pid, addresses, slot-table path, models
    $RUNTIME/NAME.responses-PORT.sqlite  the stored responses of the gateway processes on HTTP port PORT
    $RUNTIME/NAME.zygote-MODEL.sock, NAME.zygote-MODEL.spare.sock  where a model's zygote and its spare wait to be
                                  adopted should the server die (``mpserve.worker.zygote``)
    /dev/shm/mpserve-UID-TAG-NAME.slots   the slot table (TAG: of $RUNTIME's path, so that servers of one name
                                         in two runtime folders never take each other's)

A clean stop removes every one of them (docs/operations.md, "What a server leaves").

$RUNTIME is $MPSERVE_RUNTIME_DIR, else $XDG_RUNTIME_DIR/mpserve, else /tmp/mpserve-UID; it is created
with mode 0700 and refused if another user owns it or others can open it, so only this user can reach the
ipc sockets.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from mpserve.errors import ConfigError
from mpserve.private import check_private_dir
from mpserve.wire.slots import shm_dir


def runtime_dir(create: bool = True) -> Path:
    if "MPSERVE_RUNTIME_DIR" in os.environ:
        path = Path(os.environ["MPSERVE_RUNTIME_DIR"])
    elif "XDG_RUNTIME_DIR" in os.environ:
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "mpserve"
    else:
        path = Path(f"/tmp/mpserve-{os.getuid()}")
    if create:
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the runtime directory {path} ({exc.strerror}); set "
                              "MPSERVE_RUNTIME_DIR to a folder you can write") from None
        check_private_dir(path, "runtime directory")
    return path


def _tag(folder: Path) -> str:
    """A short name for ``folder``: servers are named within their runtime folder, and the slot tables of all of
    them lie in one shared folder."""
    return hashlib.sha256(os.fsencode(folder)).hexdigest()[:8]


@dataclass(frozen=True)
class ServerPaths:
    name: str
    front: str  # a ZeroMQ address
    back: str
    info: Path
    slots: Path
    admin: str = ""
    gateway_key: Path = Path()  # its secret half; the public half beside it, without "_secret"

    @classmethod
    def for_name(cls, name: str, bind: str | None = None, workers_bind: str | None = None,
                 admin_bind: str | None = None) -> ServerPaths:
        rdir = runtime_dir()
        return cls(
            name=name,
            front=bind or f"ipc://{rdir / name}.sock",
            back=workers_bind or f"ipc://{rdir / name}.workers.sock",
            info=rdir / f"{name}.json",
            slots=shm_dir() / f"mpserve-{os.getuid()}-{_tag(rdir)}-{name}.slots",
            admin=admin_bind or f"ipc://{rdir / name}.admin.sock",
            gateway_key=rdir / f"{name}.gateway.key_secret",
        )

    def ipc_files(self) -> list[Path]:
        return [Path(a[len("ipc://"):]) for a in (self.front, self.back, self.admin) if a.startswith("ipc://")]


@dataclass(frozen=True)
class ServerInfo:
    """What ``mpserve start`` publishes in NAME.json for clients and ``mpserve status``."""

    name: str
    pid: int
    front: str
    back: str
    slots: str
    models: list[str]
    started: float
    role: str = "broker"  # or "pool": `mpserve worker`, whose front and back are the remote broker's
    admin: str = ""  # the operators' address (``mpserve.server.roles``); "" from a server older than it
    version: str = ""  # the mpserve that runs it ("" from a server older than this field)

    def write(self, path: Path) -> None:
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)

    @classmethod
    def read(cls, name: str) -> ServerInfo | None:
        path = runtime_dir(create=False) / f"{name}.json"
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def alive(self) -> bool:
        return pid_alive(self.pid)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs: not gone, and not a zombie (killed or exited, its parent not having reaped it
    yet: ``kill(pid, 0)`` still finds it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: what kill said
        return True
    return stat[stat.rindex(b")") + 2:][:1] not in (b"Z", b"X")  # the state, after the name in parentheses


def default_address(name: str = "default") -> str:
    """The address a client uses when none is given: $MPSERVE_ADDRESS, else the named server's socket."""
    if "MPSERVE_ADDRESS" in os.environ:
        return os.environ["MPSERVE_ADDRESS"]
    info = ServerInfo.read(name)
    if info is not None:
        return info.front
    return f"ipc://{runtime_dir(create=False) / name}.sock"


def stopped_here(address: str) -> bool:
    """Whether the local server at ``address``, its default one, was stopped, not killed: a stop removes its socket
    and its secret file (``NAME.link``, ``mpserve.server.adoption``); a server that died leaves the secret file,
    which the next start of its name rewrites (its socket may be missing while it starts). A server at an address
    of the caller's own choosing is never taken as stopped (a client waits for it, up to its reattach bound)."""
    if not address.startswith("ipc://"):
        return False
    socket_file = address[len("ipc://"):]
    if not socket_file.endswith(".sock") or os.path.exists(socket_file):
        return False
    return not os.path.exists(socket_file[:-len(".sock")] + ".link")


def listening(path: str) -> bool:
    """Whether a process listens on the unix socket at ``path``: False when a connection there is refused (no
    listener: the socket file of a process that died); True otherwise, a full backlog included (ZeroMQ's own
    connect then tells what is wrong)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True
    return True
