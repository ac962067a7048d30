"""The server's instances of each model, as many as the load asks: scaling decisions carried out, and the
control API.

    loop turn ─▶ Instances.tick() ─ Load per model (broker: queue, running; supervisor: starting) ─▶ Scaler
                   ├ START  place_one (start-time devices less what runs) ─▶ worker_spec ─▶ supervisor.add
                   ├ DRAIN  the ready instance running least ─▶ broker.drain ─▶ STOP once idle ─▶ supervisor.retire
                   └ SKIP   one log line and one counted event
    CONTROL (broker) ─▶ Instances.control(): models / load / unload / scale / add, checked before any change
    a reload (``mpserve.server.reload``, the loop) ─▶ checked / add, check_bounds / rescale, retire,
                                                     check_roll / roll (``mpserve.server.rolling``)

Worker indices and slot-table rows are fixed at start for every model's max (``layout.instance_rows``); a
new instance takes its model's lowest free index, so a scale-up never resizes the table and ``max`` can be
changed at run time up to that ceiling only; a model added at run time takes rows kept by ``spare_slots``, as does
a roll onto a larger ``parallel`` (``rolling.allocate``).
Scale events are counted per model; the broker's STATS carries them (``scaling``) to ``/metrics``,
``mpserve models`` and ``mpserve status``. Remote pools' workers are not counted or scaled here.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from mpserve.config import loader as cfg
from mpserve.config.loader import ServerConfig
from mpserve.counts import counted
from mpserve.errors import BadRequest, ConfigError, ModelDoesNotFit, ModelFailed, UnknownModel
from mpserve.gpu.placement import ModelRequest, Placement, estimate_request, place_one
from mpserve.wire import protocol as wire
from mpserve.worker.spec import revision

from . import chat, rolling
from .broker import Broker
from .layout import Layout, check_model, instance_rows, model_request, served_chat, worker_spec
from .rolling import Roll, Step
from .scaling import Action, Decision, Load, Policy, Scaler
from .state import WorkerEntry
from .supervisor import ModelHealth, Supervisor

log = logging.getLogger("mpserve.scaling")

Planned = Sequence[tuple[list[tuple[int, int]], int]]  # rows other rolls of a reload take: (index, first row), width
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
        self._width = {m.name: m.parallel for m in config.models}  # slot-table rows each index of a model holds
        self._table_rows = config.total_slots
        self._requests = {m.name: self._sized(model_request(m)) for m in config.models}
        self.policies = {m.name: Policy(*m.bounds, m.scale_up_after, m.scale_down_after) for m in config.models}
        self._scaler = Scaler(clock)
        self._events: dict[str, Counter[str]] = {m.name: Counter() for m in config.models}
        self._next_tick = 0.0
        self._misfits: dict[str, str] = {}  # model -> why its last scale-up did not fit
        self._rolls: dict[str, Roll] = {}  # models whose instances are being replaced (``roll``)

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
            if self._broker.tables.models[name].failed is None:
                if name in self._rolls:
                    self._roll_step(name)
                self._decide(name, policy, now)

    def _decide(self, name: str, policy: Policy, now: float) -> None:
        load = self._load(name, now)
        placed: list[tuple[int, Placement]] = []
        self._act(name, self._scaler.decide(name, load, policy, lambda: self._room(name, placed)), load, placed)

    def control(self, call: wire.Control) -> wire.ControlReply:
        """An operator's call from the broker's front; a bad one raises (answered as ERROR) and changes nothing."""
        if call.op == "models":
            return self._reply(call, counted(len(self.policies), "model"))
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
        if self._allocate(high, model.parallel, more) is None:
            raise ConfigError(f"add: {model.name} needs {high * model.parallel} slot-table row(s) (max {high} × "
                              f"parallel {model.parallel}) and {self._table_rows - len(self._taken(more))} are left; "
                              "start the server with a larger --spare-slots")
        live = list(self._placements.values())
        for instance in range(max(low, 1)):
            live.append(place_one(request, instance, live, self._devices, self._config.gpu_memory_budget,
                                  single_active=self._config.single_active_backend))
        return request

    def add(self, model: cfg.ModelConfig, request: ModelRequest, why: str) -> None:
        """Serve ``model`` (``checked`` gave ``request``): its tables, then its instances as the load asks."""
        low, high = model.bounds
        rows = self._allocate(high, model.parallel)
        assert rows is not None  # checked
        self._config = dataclasses.replace(self._config, models=(*self._config.models, model))
        self._rows[model.name], self._width[model.name] = rows, model.parallel
        self._requests[model.name] = request
        self.policies[model.name] = Policy(low, high, model.scale_up_after, model.scale_down_after)
        self._events[model.name] = Counter()
        self._supervisor.health[model.name] = ModelHealth()
        self._broker.tables.models[model.name] = self._broker.tables.new_queue(model.name, self._config.max_queue)
        if model.embedding:
            self._broker.tables.embedding_models.add(model.name)
        self._broker.tables.serve_chat(model.name, *served_chat(model))  # a remote pool's must be the same
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
        if self._rolls.pop(name, None) is not None:
            self._supervisor.keep_zygote(name, False)
        for entry in self._ready(name):
            self._count(name, "stop_unload")
            self._broker.drain(entry.identity)

    # --- decisions -------------------------------------------------------------------------------

    def _load(self, name: str, now: float) -> Load:
        mq = self._broker.tables.models[name]
        ready = self._ready(name)
        oldest = now - self._broker.tables.requests[mq.queue.oldest()].accepted if mq.queue else 0.0
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
            index, where = self._start(name, placed[-1][1], decision.reason)
            log.info("scale up %s (%s): starting worker %d on %s; %d queued, the oldest for %.1f s", name,
                     decision.reason, index, where, load.queued, load.oldest_wait)
        elif decision.action is Action.DRAIN:
            old = self._rolls[name].old if name in self._rolls else set()  # a roll's old instances go first
            entry = min(self._ready(name), key=lambda w: (w.index not in old, len(w.running), -(w.index or 0)))
            self._count(name, f"stop_{decision.reason}")
            log.info("scale down %s (%s): draining worker %s; %d instance(s) stay", name, decision.reason,
                     entry.identity.decode(), load.ready - 1)
            self._broker.drain(entry.identity)
        elif decision.action is Action.SKIP:
            if decision.reason == "draining" and name in self._rolls:
                return  # a roll drains an instance to start its replacement at its index: nothing to report
            self._count(name, f"skip_{decision.reason}")
            why = self._misfits.pop(name, "") if decision.reason == "does_not_fit" else ""
            log.warning("scale-up of %s skipped (%s); %d queued, the oldest for %.1f s%s", name, decision.reason,
                        load.queued, load.oldest_wait, f": {why}" if why else "")

    def _start(self, name: str, placement: Placement, reason: str) -> tuple[int, str]:
        """Start an instance of ``name`` at ``placement`` (``_room`` found it); its index and where it runs."""
        index, first_row = self._rows[name][placement.instance]
        spec = worker_spec(self._config, self._devices, placement, index, first_row, self._backend, self._slots_path)
        self._placements[index] = placement
        self._supervisor.add(spec)
        self._count(name, f"start_{reason}")
        return index, "cpu" if placement.device is None else f"gpu{placement.device}"

    # --- rolls -----------------------------------------------------------------------------------

    def check_roll(self, model: cfg.ModelConfig, planned: Planned = ()) -> list[tuple[int, int]] | None:
        """The slot-table rows ``model``'s instances take on its new settings (None: the rows they hold), besides
        those ``planned`` for other rolls of the same reload, or the reason they cannot, raised before anything
        changes."""
        name, width = model.name, self._width[model.name]
        if model.path != cfg.ECHO_MODEL:
            check_model(model_request(model))  # a file that is not a GGUF is refused here
            request = self._sized(model_request(model))
            live = [p for p in self._placements.values() if p.model != name]  # the new ones replace the old
            for instance in range(len(self._ready(name)) + self._starting(name)):
                live.append(place_one(request, instance, live, self._devices, self._config.gpu_memory_budget,
                                      single_active=self._config.single_active_backend))
        if model.parallel <= width:
            return None
        count = len(self._rows[name])
        rows = self._allocate(count, model.parallel, planned=planned)
        if rows is None:
            free = self._table_rows - len(self._taken(planned=planned))
            rows_needed = counted(count * model.parallel, "free slot-table row")
            raise ConfigError(f"models[{name}].parallel {self._config.model(name).parallel} -> {model.parallel}: the "
                              f"roll of its {counted(count, 'instance')} needs {rows_needed}, and the table has {free} "
                              "free; start the server with a larger --spare-slots, or restart it with the new parallel")
        return rows

    def roll(self, model: cfg.ModelConfig, rows: list[tuple[int, int]] | None) -> None:
        """Serve ``model`` (an entry a reload changed; ``check_roll`` gave ``rows``) on its new settings: every
        instance started from now on gets them, and the running ones are replaced one at a time
        (``mpserve.server.rolling``). A model that had failed is tried again."""
        name = model.name
        target = len(self._ready(name)) + self._starting(name)
        self._config = dataclasses.replace(self._config, models=tuple(
            model if m.name == name else m for m in self._config.models))
        if rows is not None:
            self._rows[name], self._width[name] = rows, model.parallel
        self._requests[name] = self._sized(model_request(model))
        template, eos = served_chat(model)
        self._broker.tables.serve_chat(name, template, eos)
        mq = self._broker.tables.models[name]
        held = chat.rolled(chat.Held(mq.chat, mq.chat_local), template)  # the reload's template in force
        mq.chat, mq.chat_local = held.chat, held.local
        if mq.failed is not None:
            mq.failed, mq.crash_streak = None, 0
            self._supervisor.health[name] = ModelHealth()
        before = self._rolls[name].old if name in self._rolls else set()  # a roll not over: its old ones too
        self._rolls[name] = Roll(self._supervisor.supersede(name) | before, target)
        self._supervisor.keep_zygote(name, True)
        log.info("rolling %s onto %s: %d instance(s) to replace, one at a time", name, rolling.settings(model),
                 len(self._rolls[name].old))
        self.tick(force=True)

    def outdated(self, entry: WorkerEntry) -> None:
        """A local instance of other code or other settings registered (adopted after an upgrade to another
        mpserve version, or from a server started with another configuration): it serves until a roll replaces it
        with one of this code and settings (``mpserve.server.rolling``), one at a time, with the other such
        instances that register after it."""
        name = entry.model
        if entry.index is None or name not in self.policies:
            return
        roll = self._rolls.get(name)
        if roll is None:
            roll = self._rolls[name] = Roll(set(), 0)
            self._supervisor.keep_zygote(name, True)
            other = (f"another mpserve version ({entry.code}) than this one ({revision()})" if entry.code != revision()
                     else "other settings than this start's")
            log.info("%s: instances of %s were adopted; rolling them onto this start's, one at a time", name, other)
        roll.old |= self._supervisor.supersede(name, {entry.index})
        roll.target = max(roll.target, len(self._ready(name)) + self._starting(name))

    def _roll_step(self, name: str) -> None:
        roll = self._rolls[name]
        roll.old &= self._supervisor.workers.keys()  # those that exited are gone
        entries = [w for w in self._broker.tables.workers.values() if w.model == name and w.index is not None]
        old_ready = [w for w in entries if w.index in roll.old and not w.draining]
        placed: list[tuple[int, Placement]] = []
        turn = rolling.turn(roll.old, {w.index: w.draining for w in entries if w.index is not None},
                            self._starting(name), lambda: self._room(name, placed) is None)
        action = rolling.step(roll, turn)
        if action is Step.DONE:
            del self._rolls[name]
            self._supervisor.keep_zygote(name, False)
            self._count(name, "roll_done")
            log.info("roll of %s done: its instances run %s", name, rolling.settings(self._config.model(name)))
        elif action is Step.START:
            index, where = self._start(name, placed[-1][1], "roll")
            log.info("roll of %s: starting worker %d on %s; %d old instance(s) left", name, index, where, turn.old)
        elif action is Step.DRAIN:
            entry = min(old_ready, key=lambda w: (len(w.running), -(w.index or 0)))
            self._count(name, "stop_roll")
            running = len(entry.running)
            handed = self._broker.hand_over(entry.identity)
            how = "stopping" if not running else "handing over the requests of" if handed else "draining"
            log.info("roll of %s: %s worker %s (an old instance, running %d request(s)); %d old instance(s) left",
                     name, how, entry.identity.decode(), running, turn.old)

    def _taken(self, more: tuple[cfg.ModelConfig, ...] = (), planned: Planned = ()) -> set[int]:
        """The slot-table rows a model reserves or a worker holds (and those ``planned``, and those the models of
        ``more`` would take)."""
        reserved = [(rows, self._width[name]) for name, rows in self._rows.items()] + list(planned)
        taken = {r for rows, width in reserved for _, first in rows for r in range(first, first + width)}
        taken |= {r for handle in self._supervisor.workers.values() for r in handle.spec.rows}
        first = self._next_index(planned)
        for model in more:
            found = rolling.allocate(taken, self._table_rows, model.bounds[1], model.parallel, first)
            taken |= {r for _, row in found or () for r in range(row, row + model.parallel)}
            first += model.bounds[1]
        return taken

    def _allocate(self, count: int, width: int, more: tuple[cfg.ModelConfig, ...] = (), planned: Planned = ()
                  ) -> list[tuple[int, int]] | None:
        """(worker index, first row) for ``count`` new indices of ``width`` rows (after ``more``'s and those
        ``planned``), or None."""
        first = self._next_index(planned) + sum(m.bounds[1] for m in more)
        return rolling.allocate(self._taken(more, planned), self._table_rows, count, width, first)

    def _next_index(self, planned: Planned = ()) -> int:
        """The lowest worker index above every index a model reserves or a worker holds (or one ``planned``)."""
        lists = [*self._rows.values(), *(rows for rows, _ in planned)]
        return max([i for rows in lists for i, _ in rows] + list(self._supervisor.workers), default=-1) + 1

    def drained(self, entry: WorkerEntry) -> None:
        """``entry`` was told to STOP (drained or replaced): its process is retired."""
        if entry.index is not None and entry.index in self._supervisor.workers:
            self._supervisor.retire(entry.index)

    # --- views -----------------------------------------------------------------------------------

    def _ready(self, name: str) -> list[WorkerEntry]:
        """The model's local workers that take requests (registered, not draining)."""
        return [w for w in self._broker.tables.workers.values()
                if w.model == name and w.index is not None and not w.draining]

    def _draining(self, name: str) -> int:
        return sum(1 for w in self._broker.tables.workers.values() if w.model == name and w.draining)

    def loading(self, name: str) -> bool:
        """Whether an instance of model ``name`` is starting (``_starting``)."""
        return self._starting(name) > 0

    def _starting(self, name: str) -> int:
        """Started (or waiting to restart) and not registered yet, or registered and lost by the broker (stalled,
        left) while its process exits: the supervisor starts it again then. Not draining, so no cause to start
        another (its index is held: a start would be skipped as if one drained)."""
        known = {w.index for w in self._broker.tables.workers.values() if w.index is not None}
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
        mq = self._broker.tables.models[name]
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
            dict(self._events[name]), rolling.settings(self._config.model(name)),
            len(self._rolls[name].old) if name in self._rolls else 0)

    def _reply(self, call: wire.Control, message: str) -> wire.ControlReply:
        rows = []
        for name, policy in self.policies.items():
            ready, starting = len(self._ready(name)), self._starting(name)
            failed = self._broker.tables.models[name].failed
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
