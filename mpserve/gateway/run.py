"""``mpserve gateway``: one gateway in this process, or several on one port (``fleet``), this process their parent
until SIGINT or SIGTERM. The stored responses' file of the port (``api.response_store``) goes with the last of them.

    the command's flags (declared in ``mpserve.config.settings``, the ``gateway`` command's) ──configure──▶
        GatewayConfig: each flag not given at its declared default (image limits past the wire's: refused)
        ──serve──▶
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
from collections.abc import Mapping
from typing import Any

from mpserve import children
from mpserve.config import settings
from mpserve.config.sizes import parse_memory
from mpserve.errors import ConfigError, InternalError
from mpserve.wire import media
from mpserve.wire.media import ImageLimits

from . import app, fleet
from .api import response_store
from .api.chat import TemplateBudget
from .api.response_store import StoreBudget
from .http.access import load_keys
from .http.guard import ConnectionLimits


def configure(given: Mapping[str, Any], exit_with_parent: bool = False) -> app.GatewayConfig:
    """The gateway's configuration from its flags' values (by setting key; None: not given, so its declared
    default)."""
    v = {s.key: s.literal_default() if given.get(s.key) is None else given[s.key]
         for s in settings.for_command("gateway")}
    host, port = fleet.parse_http(v["gateway_http"])
    return app.GatewayConfig(
        host=host, port=port, connect=v["connect"], admin_connect=v["admin_connect"], server_name=v["server_name"],
        api_key=v["api_key"], request_timeout=v["request_timeout"], reattach=v["reattach"],
        curve_server_key=v["curve_server_key"], curve_secret=v["gateway_curve_secret"], log_level=v["log_level"],
        exit_with_parent=exit_with_parent, api_keys=load_keys(None, v["api_key_file"]),
        api_key_file=v["api_key_file"], ssl_certfile=v["ssl_certfile"], ssl_keyfile=v["ssl_keyfile"],
        insecure=bool(v["insecure"]),
        connections=ConnectionLimits(v["max_connections"], v["max_connections_per_client"], v["read_timeout"]),
        templates=TemplateBudget(v["template_timeout"], v["template_max_chars"]),
        responses=StoreBudget(parse_memory(v["responses_store"]), parse_memory(v["responses_store_per_key"])),
        images=_image_limits(v),
        admin_key=v["admin_key"], allowed_origins=_names(v["allowed_origins"]),
        allowed_hosts=_names(v["allowed_hosts"]))


def _image_limits(v: Mapping[str, Any]) -> ImageLimits:
    """The image and audio limits from their settings; one that is not from 1 to what the wire carries
    (``media.BOUNDS``) is refused with a ConfigError naming its flag."""
    given = {"max_images": v["max_images"], "max_image_bytes": parse_memory(v["max_image_bytes"]),
             "max_image_pixels": v["max_image_pixels"], "max_audio_seconds": v["max_audio_seconds"]}
    for key, value in given.items():
        if not 1 <= value <= media.BOUNDS[key]:
            raise ConfigError(f"{settings.BY_KEY[key].flag} is {value}; it must be from 1 to {media.BOUNDS[key]}, "
                              "what the wire carries")
    return ImageLimits(given["max_images"], given["max_image_bytes"], given["max_image_pixels"],
                       max_audio_seconds=given["max_audio_seconds"])


def _names(given: str | None) -> tuple[str, ...]:
    """A comma-separated list, as --allowed-origins and --allowed-hosts take it."""
    return tuple(name.strip() for name in (given or "").split(",") if name.strip())


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
