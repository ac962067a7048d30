"""``mpserve start``: one process that owns the broker, the supervisor, the slot table and the sockets.

A single poll loop waits on the client socket, the worker socket, every worker's process sentinel and
a self-pipe that signal handlers write to (handlers do nothing else), with a timeout set by the nearest
request deadline, worker restart or shutdown deadline; after a message it first polls without sleeping for
a moment, where that pays (``mpserve.server.waiting``). Everything is dispatched from that loop, so no
state is touched from a signal handler or a second thread.

Shutdown (SIGTERM/SIGINT): new requests get ERROR ``shutting_down``; queued and running ones finish
within ``grace`` seconds, after which they get ``shutting_down`` too; workers are told to stop, then
terminated; the slot table, the sockets and the info file are removed. A second signal skips the grace.
An error that escapes the loop ends it the same way, at once: its workers and zygotes are stopped, and
``mpserve start`` exits with status 1 (a server that serves nothing does not stay up).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from mpserve import __version__, tracing
from mpserve.config.loader import ECHO_MODEL, ModelConfig, ServerConfig
from mpserve.errors import ConfigError, ErrorCode, MpserveError, ShuttingDown
from mpserve.gpu.memory import EstimateCheck
from mpserve.gpu.placement import ModelRequest
from mpserve.llama_build import start_warnings
from mpserve.runtime import ServerInfo, ServerPaths
from mpserve.wire import protocol as wire
from mpserve.wire.adapters import Served
from mpserve.wire.slots import SlotTable
from mpserve.worker.spec import revision

from . import adoption, journal, roles
from . import reload as reloading
from .broker import Broker
from .hooks import BrokerHooks
from .instances import Instances
from .layout import Layout, build_layout, check_host_ram, served_chat, worker_specs
from .pool_keys import pool_keys
from .preflight import bind_problem, claim, refuse_live
from .residency import Residency
from .signals import SignalPipe
from .state import WorkerEntry
from .supervisor import Supervisor
from .waiting import Waiter

log = logging.getLogger("mpserve.server")


def serve(config: ServerConfig, gateway_key: Path | None = None,
          reread: Callable[[], ServerConfig] | None = None, reloaded: Callable[[], None] | None = None) -> bool:
    """Serve until a signal stops it; True when it stopped to upgrade (SIGUSR2: its instances were handed off, and
    the caller starts the server again in this process, ``mpserve.server.adoption``). ``gateway_key``: the secret
    key file of the gateway ``start --http`` runs (``roles.gateway_keys``), whose key the CURVE sockets then accept
    beside the configured ones. ``reread``: the configuration read again as at start, for a reload (SIGHUP,
    ``mpserve reload``); None: no reload. ``reloaded``: called after a reload applied (the gateways ``start --http``
    runs read their keys again)."""
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("gguf").setLevel(logging.WARNING)
    tracing.configure("broker")  # refuses a bad OTEL_* setting before anything starts
    paths = ServerPaths.for_name(config.server_name, config.bind, config.workers_bind, config.admin_bind)
    refuse_live(paths)
    started = time.monotonic()
    layout = build_layout(config)  # refuses what does not fit before anything starts
    specs = worker_specs(config, layout, paths.back, paths.slots)
    survivors = adoption.survey(paths, specs) if config.adopt_wait else adoption.Survivors()
    claim(paths)
    _say_devices(config, layout)
    table = SlotTable.create(paths.slots, rows=config.total_slots)
    ctx = zmq.Context()
    broker = None
    authenticator = None
    upgrading = False
    try:
        if config.curve_clients is not None:
            authenticator = ThreadAuthenticator(ctx, log=_AuthLog())
            authenticator.start()
            _allow_keys(authenticator, config, gateway_key)
        hooks = _ServerHooks()
        broker = _broker(ctx, config, paths, hooks)
        broker.keep_journal(journal.path_of(config.server_name), resume=bool(config.adopt_wait))
        if survivors.pids:
            broker.expect(sorted(survivors.pids), survivors.secrets, config.adopt_wait)
        adoption.write_secrets(paths, broker.secrets)
        supervisor = Supervisor(config, specs, table, gpus=bool(layout.devices), proof=broker.link_secret)
        placements = {spec.index: p for spec, p in zip(specs, layout.placements, strict=True)}
        instances = Instances(config, layout, placements, supervisor, broker, paths.back, paths.slots)
        _write_info(paths, config)
        loop = _Loop(config, broker, supervisor, instances, started, EstimateCheck(placements, layout.devices),
                     reread, reloaded, survivors)
        hooks.loop = loop  # before any socket is polled: the broker has told nothing yet
        loop.run()
        upgrading = loop.upgrading
        if not upgrading:  # a clean stop: no instance is left to adopt, nor a gateway to reattach
            _stopped_clean(paths, broker)
        return upgrading
    finally:
        if broker is not None:
            broker.close()
        if authenticator is not None:
            authenticator.stop()
        ctx.destroy(linger=0)  # closes what a failed start left open (a socket whose bind failed), then terms
        if not upgrading:  # the next start reads which instances to adopt from it
            table.unlink()
        table.close()
        for path in [paths.info, *paths.ipc_files()]:
            path.unlink(missing_ok=True)
        log.info("stopped")


def _stopped_clean(paths: ServerPaths, broker: Broker) -> None:
    """A clean stop leaves nothing for a next start to take over: no instance to adopt, no gateway to reattach, no
    request in flight (the journal)."""
    adoption.remove_secrets(paths)
    roles.remove_gateway_keys(paths)
    broker.tables.journal.remove()


def _say_devices(config: ServerConfig, layout: Layout) -> None:
    """Log the devices found, and the warnings about the host's RAM and the llama.cpp build."""
    ram_warnings = check_host_ram(config, layout)
    for device in layout.devices:
        log.info("device %d: %s, %.1f GiB free%s", device.index, device.name, device.memory_free / 2**30,
                 " (simulated)" if device.simulated else "")
    for warning in [*ram_warnings, *start_warnings(config, layout.devices)]:
        log.warning("%s", warning)


def _allow_keys(authenticator: ThreadAuthenticator, config: ServerConfig, gateway_key: Path | None) -> None:
    """The CURVE keys each socket accepts: the clients', the workers', the operators', and the gateway's."""
    assert config.curve_clients is not None
    authenticator.configure_curve(domain="clients", location=config.curve_clients)
    if config.curve_workers is not None:
        authenticator.configure_curve(domain="workers", location=config.curve_workers)
    if config.curve_admins is not None:
        authenticator.configure_curve(domain="admins", location=config.curve_admins)
    if gateway_key is not None:
        roles.allow(authenticator, gateway_key, ("clients", "admins"))


def _write_info(paths: ServerPaths, config: ServerConfig) -> None:
    """The running server's description, where ``mpserve status`` and clients find it."""
    ServerInfo(paths.name, os.getpid(), paths.front, paths.back, str(paths.slots), [m.name for m in config.models],
               time.time(), admin=paths.admin, version=__version__).write(paths.info)


def _broker(ctx: zmq.Context[zmq.Socket[bytes]], config: ServerConfig, paths: ServerPaths,
            hooks: BrokerHooks) -> Broker:
    """The broker, bound to its addresses; an address taken since ``preflight`` checked it is a ConfigError."""
    try:
        broker = Broker(ctx, paths.front, paths.back, {m.name: config.max_queue for m in config.models},
                      max_queue_total=config.max_queue_total, client_timeout=config.client_timeout,
                      max_pending_per_client=config.max_pending_per_client,
                      curve_secret=config.curve_secret, curve_workers=config.curve_workers,
                      residency=Residency(config.switch_batch) if config.single_active_backend else None,
                      heartbeat_interval=config.heartbeat_interval, heartbeat_liveness=config.heartbeat_liveness,
                      embedding_models=frozenset(m.name for m in config.models if m.embedding),
                      admin_addr=paths.admin, curve_admins=config.curve_admins,
                      no_instance_timeout=config.no_instance_timeout,
                      pool_keys=pool_keys(config.curve_workers, config.worker_models)
                      if config.curve_workers and config.worker_models else None, tenants=config.tenants,
                      hooks=hooks)
    except zmq.ZMQError as exc:
        raise ConfigError(bind_problem("--bind, --workers-bind or --admin-bind",
                                       f"{paths.front}, {paths.back} or {paths.admin}", exc.errno,
                                       exc.strerror)) from None
    for model in config.models:  # the LoRA adapters a request may name, with ids in declaration order
        broker.tables.models[model.name].adapters = Served(name for name, _ in model.adapters)
        broker.tables.serve_chat(model.name, *served_chat(model))
    return broker


class _ServerHooks(BrokerHooks):
    """The server's answers to the broker (``mpserve.server.hooks``), given to it when it is built. The loop they
    reach is built after the broker (the supervisor, the instances and the loop each need it) and attached before
    any socket is polled; until then they answer as a broker alone would."""

    def __init__(self) -> None:
        self.loop: _Loop | None = None

    def worker_ready(self, entry: WorkerEntry) -> None:
        if self.loop is not None:
            self.loop.worker_ready(entry)

    def load_failed(self, index: int, message: str) -> None:
        if self.loop is not None:
            self.loop.supervisor.load_failed(index, message)

    def worker_drained(self, entry: WorkerEntry) -> None:
        if self.loop is not None:
            self.loop.instances.drained(entry)

    def control(self, call: wire.Control) -> wire.ControlReply:
        return super().control(call) if self.loop is None else self.loop.control(call)

    def scaling(self, model: str) -> wire.ModelScaling:
        return super().scaling(model) if self.loop is None else self.loop.instances.scaling(model)

    def loading(self, model: str) -> bool:
        return self.loop is not None and self.loop.instances.loading(model)


class _AuthLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """zmq.auth logs refusals at debug level; an operator wants to see who was refused."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger("mpserve.auth"), {})

    def debug(self, msg: object, *args: object, **kwargs: object) -> None:
        # a client's key comes as z85 bytes: shown as its text (the form of its public key file), not as b'...'
        shown = tuple(a.decode("ascii", "replace") if isinstance(a, bytes) else a for a in args)
        text = str(msg) % shown if shown else str(msg)
        if "DENIED" in text:
            self.warning("refused a connection: %s", text)


def _bounds(bounds: tuple[int, int]) -> str:
    return str(bounds[0]) if bounds[0] == bounds[1] else f"{bounds[0]}..{bounds[1]}"


WATCHDOG_PERIOD_S = 0.5
HAND_OFF_S = 5.0  # an upgrade waits this long at most for the instances to answer HAND_OFF


class _Loop:
    def __init__(self, config: ServerConfig, broker: Broker, supervisor: Supervisor, instances: Instances,
                 started: float, estimates: EstimateCheck, reread: Callable[[], ServerConfig] | None,
                 reloaded: Callable[[], None] | None = None,
                 survivors: adoption.Survivors | None = None) -> None:
        self._config = config
        self._survivors = survivors or adoption.Survivors()
        self._reread = reread
        self._reloaded = reloaded
        self._broker = broker
        self.supervisor = supervisor
        self.instances = instances
        self._next_watch = 0.0
        self._next_heartbeat = 0.0
        self._started = started
        self._estimates = estimates
        self._ready: set[int] = set()
        self._announced = False
        self._grace_deadline: float | None = None
        self._signals = SignalPipe((signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2))
        self._hand_off_deadline: float | None = None  # upgrading (SIGUSR2): when the instances have answered
        self.upgrading = False  # the loop ended to hand the instances to the next start, in this process
        self._poller = zmq.Poller()
        self._waiter = Waiter(config.busy_poll_us / 1e6)

    def run(self) -> None:
        """Serve until a signal stops it. An error that escapes the loop (the broker's state is no longer to be
        trusted) stops every worker and zygote at once, then goes on up: ``mpserve start`` ends with exit status
        1, and no child outlives it (a worker left running would hold the server's exit, and its device)."""
        with self._signals:
            try:
                self._serve()
            except BaseException:
                log.critical("the server's loop failed; stopping its workers and exiting", exc_info=True)
                self.supervisor.stop_all(timeout=0.0)
                raise

    def _serve(self) -> None:
        self._poller.register(self._broker.front, zmq.POLLIN)
        self._poller.register(self._broker.back, zmq.POLLIN)
        if self._broker.admin is not None:
            self._poller.register(self._broker.admin, zmq.POLLIN)
        self._poller.register(self._signals.fileno(), zmq.POLLIN)
        self.supervisor.start_all(self._survivors.pids, self._config.adopt_wait, self._survivors.secrets)
        log.info("mpserve %s: starting %d instance(s): %s; clients connect to %s", __version__,
                 self._config.total_instances,
                 ", ".join(f"{m.name}×{_bounds(m.bounds)}" for m in self._config.models),
                 self._broker_addr())
        if self._config.total_instances == 0 and any(m.bounds[1] for m in self._config.models):
            self._announced = True
            log.info("ready: no instance runs until a request asks for one")
        elif self._config.total_instances == 0:
            self._announced = True
            log.info("ready: no local instances; waiting for remote pools at %s",
                     self._broker.back.getsockopt_string(zmq.LAST_ENDPOINT))
        while self._turn():
            pass
        if self.upgrading:
            self.supervisor.hand_off()
            return
        self._broker.stop_workers()
        self.supervisor.stop_all(timeout=5.0)

    def _broker_addr(self) -> str:
        return self._broker.front.getsockopt_string(zmq.LAST_ENDPOINT)

    def _turn(self) -> bool:
        """One pass of the loop; False when it is time to stop."""
        self.supervisor.watch(self._poller)
        events = self._waiter.wait(self._poller, self._timeout_ms())
        if self._broker.back in events:
            self._broker.drain_back()
        if self._broker.front in events:
            self._broker.drain_front()
        if self._broker.admin in events:
            self._broker.drain_admin()
        for index in self.supervisor.exited(self._poller, events):
            self._reap(index)
        while self.supervisor.failing:
            self._agree(self.supervisor.failing.pop())
        if self._signals.fileno() in events:
            self._on_signals()
        now = time.monotonic()
        self._broker.expire(now)
        if now >= self._next_watch:
            self._next_watch = now + WATCHDOG_PERIOD_S
            self._watch_progress()
            self._broker.expire_clients(now)
            self._broker.expire_workers(now)
            self._broker.expire_unserved(now)
            self._broker.expire_adoptions(now)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self._config.heartbeat_interval
            self._broker.send_heartbeats()
        self.supervisor.tick(now, restart=self._grace_deadline is None)
        if self._grace_deadline is None:
            self.instances.tick()
        self._broker.flush()  # the ASSIGNs this turn made: one message per worker
        if self._hand_off_deadline is not None and (not self._broker.tables.handing or now >= self._hand_off_deadline):
            if self._broker.tables.handing:
                log.warning("upgrading: %d instance(s) did not answer the hand-off in time; the next start adopts "
                            "them all the same if they wait", len(self._broker.tables.handing))
            self.upgrading = True
            return False
        if self._grace_deadline is None:
            return True
        if self._broker.in_flight() == 0:
            return False
        if now >= self._grace_deadline:
            log.warning("grace period over; ending %d request(s)", self._broker.in_flight())
            self._broker.abort_all(ErrorCode.SHUTTING_DOWN, "the server stopped before this request finished")
            return False
        return True

    def _timeout_ms(self) -> int:
        times = [t for t in (self._broker.next_deadline(), self.supervisor.next_timer(),
                             self._grace_deadline, self._next_watch, self.instances.next_wake()) if t is not None]
        if not times:
            return 1000
        return max(0, min(1000, int((min(times) - time.monotonic()) * 1000) + 1))

    def _watch_progress(self) -> None:
        """The busy watchdog: a worker that generated nothing for stall_timeout is replaced; its requests
        continue on other instances (``Broker.worker_stalled``)."""
        for index, silent in self.supervisor.stalled().items():
            self._broker.worker_stalled(index, silent)
            self.supervisor.stop_stalled(index)

    def _reap(self, index: int) -> None:
        """A worker exited: the supervisor collects it, the broker settles its requests by how it ended (a crash
        or a kill), and a model either of them failed is failed on both sides (``_agree``)."""
        model = self.supervisor.workers[index].spec.model
        self._ready.discard(index)
        code = self.supervisor.reap(index)
        self._broker.worker_exited(index, code)
        self._broker.adoptee_lost(index)
        self._agree(model)

    def _agree(self, model: str) -> None:
        """A model failed on either side (the supervisor's: its loads or starts fail; the broker's: its workers crash
        whatever the request) is failed on both."""
        loads = self.supervisor.health[model].failed_message
        failed = self._broker.tables.models[model].failed
        if loads is not None and failed is None:
            self._broker.model_failed(model, loads)
        elif failed is not None and loads is None:
            self.supervisor.model_failed(model, failed)

    def worker_ready(self, entry: WorkerEntry) -> None:
        assert entry.index is not None  # the broker tells of its local workers only
        self.supervisor.registered(entry.index, entry.loaded)
        if entry.code != revision() or entry.engine != self.supervisor.workers[entry.index].spec.engine.digest():
            self.instances.outdated(entry)  # adopted from a server of other code, or of other settings
        self._ready.add(entry.index)
        if entry.loaded and entry.index is not None:
            self._estimates.ready(entry.index, entry.pid)
        if not self._announced and len(self._ready) == self._config.total_instances:
            self._announced = True
            log.info("ready: %d instance(s) in %.2f s", len(self._ready), time.monotonic() - self._started)

    def _on_signals(self) -> None:
        received = self._signals.received()
        if signal.SIGUSR2 in received:
            received.discard(signal.SIGUSR2)
            if self._grace_deadline is None and self._hand_off_deadline is None:
                self._hand_off_deadline = time.monotonic() + HAND_OFF_S
                self._broker.hand_off()
                log.info("upgrading: handing %d instance(s) to the next start", len(self._broker.tables.handing))
        if signal.SIGHUP in received:
            received.discard(signal.SIGHUP)
            with contextlib.suppress(MpserveError):  # logged by reload
                self.reload("SIGHUP")
        if not received:
            return
        if self._grace_deadline is not None:
            log.warning("second signal: stopping now")
            self._grace_deadline = time.monotonic()
            return
        self._broker.stop_accepting()
        self._grace_deadline = time.monotonic() + self._config.grace
        log.info("shutting down: finishing %d request(s) within %.0f s", self._broker.in_flight(),
                 self._config.grace)

    def control(self, call: wire.Control) -> wire.ControlReply:
        """An operator's CONTROL: the instances' calls; a reload is the loop's own."""
        return self._reload_call(call) if call.op == "reload" else self.instances.control(call)

    def _reload_call(self, call: wire.Control) -> wire.ControlReply:
        """``mpserve reload``: what changed, and the models as they now are."""
        lines = self.reload("mpserve reload")
        return wire.ControlReply(call.id, "\n".join(lines),
                                 self.instances.control(wire.Control(call.id, "models")).models)

    def reload(self, why: str) -> list[str]:
        """The configuration read again and what changed applied (``mpserve.server.reload``); one line per
        change. A configuration that does not validate, or a change that cannot be made, refuses the whole reload
        (raised, and logged): the running configuration stays."""
        try:
            if self._reread is None:
                raise ConfigError("this server was not started from a configuration it can read again")
            if self._grace_deadline is not None:
                raise ShuttingDown("the server is stopping; a reload waits for the next start")
            new = self._reread()
            known = {m.name: m for m in self._config.models}  # with the bounds reloads gave them
            running = dataclasses.replace(self._config, models=tuple(  # and those `mpserve add` gave the instances
                known.get(m.name, m) for m in self.instances.models() if m.name not in self._broker.tables.removed))
            changes = reloading.diff(running, new)
            requests, rows = self._checked(changes)
        except MpserveError as exc:
            log.error("reload (%s) refused, the running configuration stays: %s", why, exc.message)
            raise
        for model in changes.added:
            if model.name in self._broker.tables.removed:
                self._broker.tables.removed.discard(model.name)
                if model.name in rows:  # it comes back with other settings
                    self.instances.roll(model, rows[model.name])
                self.instances.rescale(model)
            else:
                self.instances.add(model, requests[model.name], "reload")
        for model in changes.bounds.values():
            self.instances.rescale(model)
        for name in changes.removed:
            self._broker.tables.removed.add(name)
            self.instances.retire(name)
        for name, (model, _) in changes.rolled.items():
            self.instances.roll(model, rows[name])
        for key, (_, value) in changes.at_once.items():
            self._apply(key, value)
        self._config = reloading.applied(running, changes)
        if self._reloaded is not None:
            self._reloaded()
        lines = changes.lines()
        for line in lines:
            log.info("reload (%s): %s", why, line)
        return lines

    def _checked(self, changes: reloading.Changes
                 ) -> tuple[dict[str, ModelRequest], dict[str, list[tuple[int, int]] | None]]:
        """What each added model asks, and the rows each rolled one takes (a model removed before and served
        again with other settings rolls too), once every change is known to be possible; raises otherwise."""
        for model in changes.bounds.values():
            self.instances.check_bounds(model.name, *model.bounds)
        rolls = [model for model, _ in changes.rolled.values()]
        requests: dict[str, ModelRequest] = {}
        added: tuple[ModelConfig, ...] = ()
        for model in changes.added:
            if model.name in self._broker.tables.removed:  # served again: its tables are there, its settings may roll
                removed = self.instances.model(model.name)
                kept = [key for key in sorted(reloading.MODEL_KEPT) if getattr(removed, key) != getattr(model, key)]
                if kept:
                    raise ConfigError(f"models[{model.name}] was removed by a reload and comes back serving "
                                      f"otherwise ({', '.join(kept)}): give it another name, or restart")
                if reloading.settings_differ(removed, model):
                    rolls.append(model)
                self.instances.check_bounds(model.name, *model.bounds)
                continue
            _local_file(model)
            requests[model.name] = self.instances.checked(model, added)
            added = (*added, model)
        rows: dict[str, list[tuple[int, int]] | None] = {}
        planned: list[tuple[list[tuple[int, int]], int]] = []  # the rows the rolls before take, with their width
        for model in rolls:
            _local_file(model)
            rows[model.name] = found = self.instances.check_roll(model, planned)
            if found is not None:
                planned.append((found, model.parallel))
        return requests, rows

    def _apply(self, key: str, value: object) -> None:
        """A server setting that applies at once (``reload.AT_ONCE``)."""
        if key == "max_queue":
            for mq in self._broker.tables.models.values():
                mq.max_queue = int(value)  # type: ignore[call-overload]
        elif key == "log_level":
            logging.getLogger().setLevel(str(value).upper())
        elif key == "tenants":
            self._broker.tables.ledger.configure(value)  # type: ignore[arg-type]
            self._broker.dispatch_all()  # a limit raised or gone lets waiting requests start
        elif key != "grace":  # the loop reads grace from its configuration
            setattr(self._broker, key, value)


def _local_file(model: ModelConfig) -> None:
    """``ConfigError`` unless the model's file is on this host (a reload does not download)."""
    if model.path != ECHO_MODEL and not os.path.isfile(model.resolved_path()):
        raise ConfigError(f"models[{model.name}].path {model.path}: no such file here; download it first "
                          f"(mpserve pull {model.path}), then reload")
