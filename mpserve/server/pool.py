"""``mpserve worker --connect tcp://BROKER:PORT``: a pool of workers on another host.

The pool is a supervisor without a broker: it places its instances on this host's devices, keeps its own
slot table (so ``mpserve status --server-name NAME`` works here), and starts, reaps and restarts its
workers. Each worker connects to the remote broker's worker socket itself, registers (READY with this
host's name), and keeps the link alive with heartbeats both ways: if the broker falls silent (it
restarted, or declared this worker lost), the worker registers again, backing off with jitter, and
ZeroMQ reconnects the TCP link by itself. Requests never pass through the pool process.

The pool runs the busy watchdog for its workers, as the server does for its own: a worker that generated
nothing for ``stall_timeout`` while busy is stopped (SIGTERM, then SIGKILL) and started again. The broker
has by then declared it lost (its heartbeats stopped too) and dealt with its requests.

The broker sees a remote worker leave (LEAVING) or fall silent, never how it ended: whatever the cause (a
crash, a kill, a stall, the pool stopping or dying), its requests are handed over, as after a kill (resumed
elsewhere, up to the broker's bound on hand-overs per request); no remote death counts toward
``poison_request`` or fails a model.

On SIGTERM/SIGINT the pool terminates its workers: each says LEAVING as it exits (within ``LEAVE_GRACE_S``,
else it is killed), so the broker forgets it at once and hands its requests over. A pool killed outright leaves
its workers running (they have sessions of their own); each notices within a second that the pool is gone and
leaves the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import time

import zmq

from mpserve.config.loader import ServerConfig
from mpserve.llama_build import start_warnings
from mpserve.runtime import ServerInfo, ServerPaths
from mpserve.wire.slots import SlotTable

from .layout import build_layout, check_host_ram, worker_specs
from .loop import WATCHDOG_PERIOD_S
from .preflight import claim
from .signals import SignalPipe
from .supervisor import Supervisor

log = logging.getLogger("mpserve.pool")

LEAVE_GRACE_S = 10.0  # a worker told to stop finishes its step and says LEAVING (the broker hands its requests over at
# once); a step of a large model on a busy host can take seconds, and one killed first is lost only at its silence


def run_pool(config: ServerConfig, connect: str, curve_server_key: str | None = None,
             curve_secret: str | None = None) -> None:
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    paths = ServerPaths.for_name(config.server_name)
    claim(paths)
    layout = build_layout(config)
    for warning in [*check_host_ram(config, layout), *start_warnings(config, layout.devices)]:
        log.warning("%s", warning)
    pool = f"{socket.gethostname()[:32]}-{os.getpid()}"
    specs = [dataclasses.replace(spec, pool=pool, curve_server_key=curve_server_key, curve_secret=curve_secret,
                                 heartbeat_interval=config.heartbeat_interval,
                                 heartbeat_liveness=config.heartbeat_liveness)
             for spec in worker_specs(config, layout, connect, paths.slots)]
    table = SlotTable.create(paths.slots, rows=config.total_slots)
    try:
        supervisor = Supervisor(config, specs, table, gpus=bool(layout.devices))
        ServerInfo(paths.name, os.getpid(), connect, connect, str(paths.slots), [m.name for m in config.models],
                   time.time(), role="pool").write(paths.info)
        log.info("pool %s: %d instance(s) of %s for the broker at %s", pool, len(specs),
                 ", ".join(m.name for m in config.models), connect)
        _supervise(supervisor)
    finally:
        table.unlink()
        table.close()
        paths.info.unlink(missing_ok=True)


def _supervise(supervisor: Supervisor) -> None:
    """Start the workers; reap, restart, and stop stalled ones, until a signal says stop."""
    poller = zmq.Poller()
    next_watch = 0.0
    with SignalPipe() as signals:
        poller.register(signals.fileno(), zmq.POLLIN)
        supervisor.start_all()
        while True:
            supervisor.watch(poller)
            wake = min(t for t in (supervisor.next_timer(), next_watch) if t is not None)
            events = dict(poller.poll(max(0, min(1000, int((wake - time.monotonic()) * 1000) + 1))))
            if signals.fileno() in events and signals.received():
                log.info("stopping the pool's workers")
                break
            for index in supervisor.exited(poller, events):
                supervisor.reap(index)
            now = time.monotonic()
            if now >= next_watch:
                next_watch = now + WATCHDOG_PERIOD_S
                for index in supervisor.stalled():
                    supervisor.stop_stalled(index)
            supervisor.tick(now)
        supervisor.stop_all(timeout=0, leave_grace=LEAVE_GRACE_S)
