"""What ``mpserve start`` runs, as one unit: the server in this process, the gateway fleet of ``--http`` beside it,
and the upgrade's exec that starts the mpserve installed now in this very process.

    run(config, flags)
      check_start ──▶ every address, folder and model file checked (a problem: one line, nothing started)
      --http ──▶ Gateways: the port listened on here (or handed over by the start before this one, across its exec),
                 --http-workers ``mpserve gateway --fd`` children (``gateway.fleet``), each started again when it
                 dies; they keep giving up ──▶ SIGINT to this process, and InternalError once the server stopped
      pull ──▶ the models named on the Hub downloaded, with the gateway up (its console shows the downloads)
      serve ──▶ the server until a signal stops it (``server.loop``)
        SIGHUP / reload ──▶ the gateways read their keys again
        SIGUSR2 / ``mpserve upgrade`` ──▶ the instances handed off; the port and the gateways handed over
          ──▶ exec_again(): this process becomes ``python -m mpserve start …`` of the mpserve installed now (its pid
              stays, for the service manager), and its start adopts the instances

The gateways are processes apart from the server's: in the broker's, a gateway would compete with the broker loop
for the GIL, and a fault in it could not touch the broker. The top process stays small, as gunicorn's arbiter.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpserve import children
from mpserve.config import loader as cfg
from mpserve.config import settings
from mpserve.errors import InternalError
from mpserve.runtime import ServerPaths

IMAGE_LIMITS = ("max_images", "max_image_bytes", "max_image_pixels", "max_audio_seconds")  # the gateway's flags
# start --http passes on
LISTEN_AFTER_DEATH_S = 10.0  # how long start --http waits for the gateways of a server that died to let its port go


def run(config: cfg.ServerConfig, flags: dict[str, Any], reread: Callable[[], cfg.ServerConfig],
        pull: Callable[[cfg.ServerConfig], None]) -> bool:
    """Serve ``config`` (with the gateways of ``flags["http"]``, the ``start`` command's own flags) until a signal
    stops it; True when it stopped to upgrade (the caller leaves its error handling, then ``exec_again``).
    ``reread``: the configuration read again as at start, for a reload; ``pull``: the models' downloads."""
    from mpserve.gateway import fleet
    from mpserve.server.adoption import died_before
    from mpserve.server.loop import serve
    from mpserve.server.preflight import check_start
    from mpserve.server.roles import gateway_keys

    http = flags["http"]
    # the port is checked unless an upgrade hands it over, or the gateways of a server that died still hold it
    checked = http and fleet.HANDED_FD not in os.environ and not died_before(config.server_name)
    check_start(config, fleet.parse_http(http) if checked else None)
    paths = ServerPaths.for_name(config.server_name, config.bind, config.workers_bind, config.admin_bind)
    gateway_key = gateway_keys(paths) if http and config.curve_secret else None  # for a CURVE front
    with Gateways(http, config, flags, gateway_key) if http else contextlib.nullcontext() as gateways:
        pull(config)  # with the gateway up: /backend/monitor and the console show the downloads
        reloaded = (lambda: gateways.fleet.signal(signal.SIGHUP)) if gateways is not None else None
        upgrading = serve(config, gateway_key, reread=reread, reloaded=reloaded)
        if upgrading and gateways is not None:
            gateways.hand_over()
    return upgrading


def exec_again() -> None:
    """The mpserve installed now, in this process, with this start's arguments (its pid stays, for the service
    manager); the handed-over port and gateways travel in the environment (``gateway.fleet``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, children.python("-m", "mpserve", *sys.argv[1:]))


class Gateways:
    """The gateway processes that ``start --http`` runs (``--http-workers``, on one port: ``gateway.fleet``), each
    started again when it dies; the port stays served by the others meanwhile. If they keep dying as they start,
    the fleet gives up: it interrupts the server (SIGINT, as Ctrl-C: a graceful stop), and leaving the ``with``
    raises ``InternalError`` (exit status 1), for the service manager to see one failed unit instead of a server
    that runs on without its HTTP API."""

    def __init__(self, http: str, config: cfg.ServerConfig, flags: dict[str, Any], key: Path | None) -> None:
        from mpserve.gateway import fleet
        from mpserve.gateway.api import response_store
        from mpserve.server.adoption import died_before

        host, port = fleet.parse_http(http)
        handed = fleet.handed_over(host, port)  # an upgrade: the socket of the start before this one, and its gateways
        command, env = gateway_command(http, config, flags, key)
        if handed is not None:
            sock = handed[0]
        else:  # the gateways of the server before this one, if it died, let the port go as they notice
            sock = fleet.listen(host, port, LISTEN_AFTER_DEATH_S if died_before(config.server_name) else 0.0)
        self.fleet = fleet.Fleet(sock, flags["http_workers"] or 1, command, env, self._give_up,
                                 response_store.path_for(config.server_name, port))
        fleet.drain(handed[1] if handed is not None else [])
        self._handed_over = False

    def hand_over(self) -> None:
        """An upgrade: the port and the gateways go on to the start that follows in this process."""
        self.fleet.hand_over()
        self._handed_over = True

    def _give_up(self, reason: str) -> None:
        os.kill(os.getpid(), signal.SIGINT)

    def __enter__(self) -> Gateways:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if not self._handed_over:
            self.fleet.stop()
        if self.fleet.gave_up is not None:
            raise InternalError(f"{self.fleet.gave_up}, so the server stopped (its log above says why); fix that and "
                                "start again")


def gateway_command(http: str, config: cfg.ServerConfig, flags: dict[str, Any],
                    key: Path | None) -> tuple[Callable[[int], list[str]], dict[str, str]]:
    """How to run one ``mpserve gateway`` child on an inherited socket, and its environment. Each child runs in
    its own session: Ctrl-C reaches only the server, which drains its requests while the gateways keep streaming
    them (and answer 503 to new ones); they are stopped after that. If the server dies outright, they let the port
    go for its next start's gateways, and finish their streams on that start (reattached) before they exit. The
    keys travel in the environment, not in the command line that any user can read; ``key``, a key pair the server
    accepts, lets them through a CURVE front (the server's public key is read from its secret key file)."""
    from mpserve.gateway import fleet
    from mpserve.gateway.http import access
    from mpserve.gateway.run import configure

    host, _ = fleet.parse_http(http)  # refuse a bad value, a network port without a key, before anything starts
    access.check_exposure(host, access.load_keys(flags["api_key"], flags["api_key_file"]), config.insecure)
    access.check_tls(flags["ssl_certfile"], flags["ssl_keyfile"])
    configure({"gateway_http": http, **{key: flags[key] for key in IMAGE_LIMITS}})  # image limits past the wire's
    keys = {"MPSERVE_API_KEY": flags["api_key"], "MPSERVE_ADMIN_KEY": flags["admin_key"],
            "MPSERVE_CURVE_SERVER_KEY": config.curve_secret if key else None,
            "MPSERVE_CURVE_CLIENT_SECRET": str(key) if key else None,
            "MPSERVE_ALLOWED_ORIGINS": flags["allowed_origins"], "MPSERVE_ALLOWED_HOSTS": flags["allowed_hosts"]}
    env = {**os.environ, **{name: key for name, key in keys.items() if key}}
    passed = [arg for key in ("api_key_file", "ssl_certfile", "ssl_keyfile", "request_timeout", "reattach",
                              *IMAGE_LIMITS) if flags[key] is not None
              for arg in (settings.BY_KEY[key].flag or "", str(flags[key]))]
    argv = [*children.python("-m", "mpserve", "gateway", "--http", http, "--server-name", config.server_name),
            "--log-level", config.log_level, *passed, *(["--insecure"] if config.insecure else [])]
    return functools.partial(fleet.child_command, argv), env
