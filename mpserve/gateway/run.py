"""``mpserve gateway``: one gateway in this process, or several on one port (``fleet``), this process their parent
until SIGINT or SIGTERM. The stored responses' file of the port (``api.response_store``) goes with the last of them.

    one gateway ──▶ ``app.serve`` here ──▶ it ends: the file removed, unless it served a socket a fleet's parent
                    bound (``fd``: that parent removes it)
    several     ──▶ ``fleet.Fleet``, their parent ──▶ SIGINT or SIGTERM ──▶ ``Fleet.stop``: each stopped, the file
                    removed
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import threading

from mpserve import children
from mpserve.errors import InternalError

from . import app, fleet
from .api import response_store


def serve(config: app.GatewayConfig, workers: int, fd: int | None) -> None:
    store = response_store.path_for(config.server_name, config.port)
    if workers == 1:
        app.serve(config, fd)
        if fd is None:
            response_store.remove(store)
        return
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app.check(config)
    ended = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: ended.set())
    argv = children.python("-m", "mpserve", *sys.argv[1:])
    gateways = fleet.Fleet(fleet.listen(config.host, config.port), workers,
                           functools.partial(fleet.child_command, argv), dict(os.environ), lambda _: ended.set(), store)
    signal.signal(signal.SIGHUP, lambda *_: gateways.signal(signal.SIGHUP))  # the key file read again
    logging.getLogger("mpserve.gateway").info("%d gateway processes on http://%s:%d: %s", workers, config.host,
                                              config.port, " ".join(map(str, gateways.pids)))
    ended.wait()
    gateways.stop()
    if gateways.gave_up is not None:
        raise InternalError(f"{gateways.gave_up} (its log above says why); fix that and start again")
