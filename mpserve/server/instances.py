"""The server's instances of each model, as many as the load asks: scaling decisions carried out, and the
control API.

    loop turn ─▶ Instances.tick() ─ Load per model (broker: queue, running; supervisor: starting) ─▶ Scaler
                   ├ START  place_one (start-time devices less what runs) ─▶ worker_spec ─▶ supervisor.add
                   ├ DRAIN  the ready instance running least ─▶ broker.drain ─▶ STOP once idle ─▶ supervisor.retire
                   └ SKIP   one log line and one counted event
    CONTROL (broker) ─▶ Instances.control(): models / load / unload / scale / add, checked before any change
    a reload (``mpserve.server.reload``, the loop) ─▶ checked / add, check_bounds / rescale, retire

Worker indices and slot-table rows are fixed at start for every model's max (``layout.instance_rows``); a
new instance takes its model's lowest free index, so a scale-up never resizes the table and ``max`` can be
changed at run time up to that ceiling only; a model added at run time takes rows kept by ``spare_slots``.
Scale events are counted per model; the broker's STATS carries them (``scaling``) to ``/metrics``,
``mpserve models`` and ``mpserve status``. Remote pools' workers are not counted or scaled here.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from mpserve.config import loader as cfg
from mpserve.config.loader import ServerConfig
from mpserve.errors import BadRequest, ConfigError, ModelDoesNotFit, ModelFailed, UnknownModel
from mpserve.gpu.placement import ModelRequest, Placement, estimate_request, place_one
from mpserve.wire import protocol as wire

from .broker import Broker
from .layout import Layout, check_model, instance_rows, model_request, served_template, worker_spec
from .scaling import Action, Decision, Load, Policy, Scaler
from .state import WorkerEntry
from .supervisor import ModelHealth, Supervisor

log = logging.getLogger("mpserve.scaling")

TICK_S = 0.05  # decisions are taken at most this often; the loop wakes for the scaler's next deadline


class Instances:
    def __init__(self, config: ServerConfig, layout: Layout, placements: dict[int, Placement],
                 supervisor: Supervisor, broker: Broker, backend: str, slots_path: Path,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``placements``: the started instances' placements, by worker index."""
        self._config = config
        self._devices = layout.devices
        self._placements = dict(placements)
        self._supervisor = supervisor
        self._broker = broker
        self._backend = backend
        self._slots_path = slots_path
        self._clock = clock
        self._rows = instance_rows(config)
        self._table_rows = config.total_slots
        self._requests = {m.name: self._sized(model_request(m)) for m in config.models}
        self.policies = {m.name: Policy(*m.bounds, m.scale_up_after, m.scale_down_after) for m in config.models}
        self._scaler = Scaler(clock)
        self._events: dict[str, Counter[str]] = {m.name: Counter() for m in config.models}
        self._next_tick = 0.0
        self._misfits: dict[str, str] = {}  # model -> why its last scale-up did not fit
        broker.on_drained = self._drained
        broker.on_control = self.control
        broker.scaling_of = self.scaling
        broker.loading = lambda name: self._starting(name) > 0

    def next_wake(self) -> float | None:
        wake = self._scaler.next_wake()
        return None if wake is None else max(wake, self._next_tick)

    def tick(self, force: bool = False) -> None:
        """Take each model's scaling decision and carry it out."""
        now = self._clock()
        if now < self._next_tick and not force:
            return
        self._next_tick = now + TICK_S
        for index in [i for i in self._placements if i not in self._supervisor.workers]:
            del self._placements[index]  # a scaled-down worker has exited: its memory is free
        for name, policy in self.policies.items():
            if self._broker.models[name].failed is None:
                self._decide(name, policy, now)

    def _decide(self, name: str, policy: Policy, now: float) -> None:
        load = self._load(name, now)
        placed: list[tuple[int, Placement]] = []
        self._act(name, self._scaler.decide(name, load, policy, lambda: self._room(name, placed)), load, placed)

    def control(self, call: wire.Control) -> wire.ControlReply:
        """An operator's call from the broker's front; a bad one raises (answered as ERROR) and changes nothing."""
        if call.op == "models":
            return self._reply(call, f"{len(self.policies)} model(s)")
        if call.op == "add":
            return self._add(call)
        name = call.model
        if name is None or name not in self.policies:
            raise UnknownModel(f"model {name!r} is not served here; served models: {', '.join(self.policies)}")
        policy = self.policies[name]
        if call.op == "scale":
            low = policy.min if call.min is None else call.min
            high = policy.max if call.max is None else call.max
        else:
            low, high = (max(1, policy.min) if call.op == "load" else 0), policy.max
        self._check(name, low, high)
        policy.min, policy.max = low, high
        self._scaler.forget(name)
        if call.op == "unload":
            for entry in self._ready(name):
                self._count(name, "stop_unload")
                self._broker.drain(entry.identity)
        log.info("%s %s: instances %d..%d (control call)", call.op, name, low, high)
        self.tick(force=True)
        return self._reply(call, f"{call.op} {name}: instances {low}..{high}")

    def _add(self, call: wire.Control) -> wire.ControlReply:
        """Serve a new model, refused as at start (``config``, ``does_not_fit``) or for want of slot rows."""
        assert call.path is not None  # Control.validate
        low = 1 if call.min is None else call.min
        entry = {"path": call.path, "instances": {"min": low, "max": max(low, 1) if call.max is None else call.max}}
        model = cfg.added_model({**entry, **({"name": call.model} if call.model else {})}, len(self.policies), "add")
        self.add(model, self.checked(model), "control call")
        low, high = model.bounds
        return self._reply(call, f"add {model.name}: instances {low}..{high}")

    def checked(self, model: cfg.ModelConfig, more: tuple[cfg.ModelConfig, ...] = ()) -> ModelRequest:
        """What serving ``model`` asks (after the models of ``more`` are added too), or the reason it cannot be
        served, raised before anything changes."""
        if model.name in self.policies:
            raise BadRequest(f"model {model.name!r} is served already; give the new one another name (--name)")
        request = model_request(model)
        if model.path != cfg.ECHO_MODEL:  # a file that is not a GGUF is refused here, before anything changes
            check_model(request)
            estimated = estimate_request(request)
            request = request if request.memory is not None or not self._devices else dataclasses.replace(
                request, memory=estimated.total)
        low, high = model.bounds
        used = sum(m.bounds[1] * m.parallel for m in (*self._config.models, *more))
        if used + high * model.parallel > self._table_rows:
            raise ConfigError(f"add: {model.name} needs {high * model.parallel} slot-table row(s) (max {high} × "
                              f"parallel {model.parallel}) and {self._table_rows - used} are left; start the server "
                              "with a larger --spare-slots")
        live = list(self._placements.values())
        for instance in range(max(low, 1)):
            live.append(place_one(request, instance, live, self._devices, self._config.gpu_memory_budget,
                                  single_active=self._config.single_active_backend))
        return request

    def add(self, model: cfg.ModelConfig, request: ModelRequest, why: str) -> None:
        """Serve ``model`` (``checked`` gave ``request``): its tables, then its instances as the load asks."""
        low, high = model.bounds
        self._config = dataclasses.replace(self._config, models=(*self._config.models, model))
        self._rows = instance_rows(self._config)
        self._requests[model.name] = request
        self.policies[model.name] = Policy(low, high, model.scale_up_after, model.scale_down_after)
        self._events[model.name] = Counter()
        self._supervisor.health[model.name] = ModelHealth()
        self._broker.models[model.name] = self._broker.new_queue(model.name, self._config.max_queue)
        if model.embedding:
            self._broker.embedding_models |= {model.name}
        template = served_template(model)
        if template is not None:  # the one a remote pool of the model must serve (``mpserve.server.chat``)
            self._broker.chat_templates[model.name] = template
        log.info("add %s: %s, instances %d..%d (%s)", model.name, model.path, low, high, why)
        self.tick(force=True)

    def models(self) -> tuple[cfg.ModelConfig, ...]:
        """Every model served: those of the start, and those added since (``add``, a reload)."""
        return self._config.models

    def model(self, name: str) -> cfg.ModelConfig:
        """The settings ``name`` is served with."""
        return self._config.model(name)

    def check_bounds(self, name: str, low: int, high: int) -> None:
        """``BadRequest`` (or ``does_not_fit``) if ``name`` cannot run ``low`` .. ``high`` instances."""
        self._check(name, low, high)

    def rescale(self, model: cfg.ModelConfig) -> None:
        """A reload's new bounds and scaling delays of a model (``check_bounds`` passed)."""
        low, high = model.bounds
        self.policies[model.name] = Policy(low, high, model.scale_up_after, model.scale_down_after)
        self._scaler.forget(model.name)
        self.tick(force=True)

    def retire(self, name: str) -> None:
        """A model a reload removed: its instances drain once they run nothing, and none starts again but for its
        requests still queued."""
        policy = self.policies[name]
        policy.min = 0
        self._scaler.forget(name)
        for entry in self._ready(name):
            self._count(name, "stop_unload")
            self._broker.drain(entry.identity)

    # --- decisions -------------------------------------------------------------------------------

    def _load(self, name: str, now: float) -> Load:
        mq = self._broker.models[name]
        ready = self._ready(name)
        oldest = now - self._broker.requests[mq.queue.oldest()].accepted if mq.queue else 0.0
        return Load(len(mq.queue), oldest, sum(len(w.running) for w in ready), len(ready), self._starting(name),
                    self._config.model(name).parallel)

    def _room(self, name: str, placed: list[tuple[int, Placement]]) -> str | None:
        """Why one more instance of ``name`` cannot start now, or None (and its index and placement in
        ``placed``)."""
        free = self._free_instance(name)
        if free is None:
            return "draining"  # every index of the model is held, some by instances still draining
        try:
            placement = place_one(self._requests[name], free[0], list(self._placements.values()), self._devices,
                                  self._config.gpu_memory_budget, single_active=self._config.single_active_backend)
        except ModelDoesNotFit as exc:
            self._misfits[name] = exc.message
            return "does_not_fit"
        placed.append((free[1], placement))
        return None

    def _act(self, name: str, decision: Decision, load: Load, placed: list[tuple[int, Placement]]) -> None:
        if decision.action is Action.START:
            index, placement = placed[-1]
            rows = self._rows[name][placement.instance]
            spec = worker_spec(self._config, self._devices, placement, rows[0], rows[1], self._backend,
                               self._slots_path)
            self._placements[index] = placement
            self._supervisor.add(spec)
            self._count(name, f"start_{decision.reason}")
            where = "cpu" if placement.device is None else f"gpu{placement.device}"
            log.info("scale up %s (%s): starting worker %d on %s; %d queued, the oldest for %.1f s", name,
                     decision.reason, index, where, load.queued, load.oldest_wait)
        elif decision.action is Action.DRAIN:
            entry = min(self._ready(name), key=lambda w: (len(w.running), -(w.index or 0)))
            self._count(name, f"stop_{decision.reason}")
            log.info("scale down %s (%s): draining worker %s; %d instance(s) stay", name, decision.reason,
                     entry.identity.decode(), load.ready - 1)
            self._broker.drain(entry.identity)
        elif decision.action is Action.SKIP:
            self._count(name, f"skip_{decision.reason}")
            why = self._misfits.pop(name, "") if decision.reason == "does_not_fit" else ""
            log.warning("scale-up of %s skipped (%s); %d queued, the oldest for %.1f s%s", name, decision.reason,
                        load.queued, load.oldest_wait, f": {why}" if why else "")

    def _drained(self, entry: WorkerEntry) -> None:
        if entry.index is not None and entry.index in self._supervisor.workers:
            self._supervisor.retire(entry.index)

    # --- views -----------------------------------------------------------------------------------

    def _ready(self, name: str) -> list[WorkerEntry]:
        """The model's local workers that take requests (registered, not draining)."""
        return [w for w in self._broker.workers.values()
                if w.model == name and w.index is not None and not w.draining]

    def _draining(self, name: str) -> int:
        return sum(1 for w in self._broker.workers.values() if w.model == name and w.draining)

    def _starting(self, name: str) -> int:
        """Started (or waiting to restart) and not registered yet, or registered and lost by the broker (stalled,
        left) while its process exits: the supervisor starts it again then. Not draining, so no cause to start
        another (its index is held: a start would be skipped as if one drained)."""
        known = {w.index for w in self._broker.workers.values() if w.index is not None}
        return sum(1 for index, h in self._supervisor.workers.items()
                   if h.spec.model == name and not h.retiring and (not h.registered or index not in known)
                   and (h.process is not None or h.restart_at is not None))

    def _free_instance(self, name: str) -> tuple[int, int] | None:
        """(instance number, worker index) of the model's lowest index no worker holds."""
        return next(((i, index) for i, (index, _) in enumerate(self._rows[name])
                     if index not in self._supervisor.workers), None)

    def _check(self, name: str, low: int, high: int) -> None:
        ceiling = self._config.model(name).bounds[1]
        if high > ceiling:
            raise BadRequest(f"max {high} is above {ceiling}, the most instances of {name} this server was started "
                             f"for (its max_instances); restart it with a higher max")
        if low > high:
            raise BadRequest(f"min {low} is above max {high}; give min ≤ max")
        mq = self._broker.models[name]
        if mq.failed is not None and low > 0:
            raise ModelFailed(mq.refusal())
        live = list(self._placements.values())
        for instance in range(len(self._ready(name)) + self._starting(name), low):
            live.append(place_one(self._requests[name], instance, live, self._devices, self._config.gpu_memory_budget,
                                  single_active=self._config.single_active_backend))

    def _count(self, name: str, event: str) -> None:
        self._events[name][event] += 1

    def scaling(self, name: str) -> wire.ModelScaling:
        """The model's bounds, counts and scale events, for the broker's STATS."""
        policy = self.policies[name]
        return wire.ModelScaling(
            policy.min, policy.max, self._config.model(name).bounds[1], self._starting(name), self._draining(name),
            dict(self._events[name]))

    def _reply(self, call: wire.Control, message: str) -> wire.ControlReply:
        rows = []
        for name, policy in self.policies.items():
            ready, starting, failed = len(self._ready(name)), self._starting(name), self._broker.models[name].failed
            state = ("failed" if failed is not None else "ready" if ready else "starting" if starting
                     else "scaled to zero")
            rows.append(wire.ModelControl(name, self._config.model(name).path, ready, starting, self._draining(name),
                                          policy.min, policy.max, self._config.model(name).bounds[1], state))
        return wire.ControlReply(call.id, message, rows)

    def _sized(self, request: ModelRequest) -> ModelRequest:
        """The request with its memory estimated once (placement asks on every scale-up)."""
        if request.memory is not None or not self._devices:
            return request
        total = estimate_request(request).total
        return dataclasses.replace(request, memory=total)
