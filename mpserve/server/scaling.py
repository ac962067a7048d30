"""When a model's instance count changes: one decision per model per loop turn, on an injected clock.

    broker: queued, running, oldest wait ──┐
    instances: ready, starting ────────────┼─▶ Load ─▶ Scaler.decide(model, load, policy, room) ─▶ Decision
    placement: why one more cannot start ──┘                        START / DRAIN / SKIP / NONE, with a reason

The rules, first match wins:

    one start in flight            nothing (at most one start in flight per model; no drain while it runs)
    below min                      START ``min``  (or SKIP with ``room``'s reason, e.g. ``does_not_fit``)
    above max                      DRAIN ``max``
    requests wait, no instance     START ``demand`` at once: scale from zero  (or SKIP as above)
    oldest waited > scale_up_after START ``queue``  (or SKIP ``at_max``, or as above); not for a fixed count
                                   (min = max), which waits for its instances without a word
    spare for scale_down_after     DRAIN ``idle``: nothing queued and an instance's worth of slots idle all along,
                                   above min; the wait starts afresh after each drain

A SKIP is reported once per episode (until the overdue wait ends or the reason changes), so the caller may
log and count every SKIP it gets. The caller owns the instances: it starts, drains and asks placement; this
module only decides.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


class Action(Enum):
    NONE = "none"
    START = "start"
    DRAIN = "drain"
    SKIP = "skip"  # a start was due but cannot happen


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str = ""  # START: min, demand, queue; DRAIN: max, idle; SKIP: at_max, or room's reason


NOTHING = Decision(Action.NONE)


@dataclass(frozen=True)
class Load:
    """What a model looks like now."""

    queued: int
    oldest_wait: float  # seconds the head of its queue has waited; 0 when none waits
    running: int  # requests on its instances
    ready: int  # instances registered and taking requests (not draining)
    starting: int  # instances started and not registered yet
    capacity: int  # slots per instance


@dataclass
class Policy:
    """A model's bounds and delays; the control API changes min and max at run time."""

    min: int
    max: int
    scale_up_after: float
    scale_down_after: float


class Scaler:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._spare_since: dict[str, float] = {}
        self._skipped: dict[str, str] = {}  # model -> the reason already reported for this episode
        self._wakes: dict[str, float] = {}

    def decide(self, model: str, load: Load, policy: Policy, room: Callable[[], str | None]) -> Decision:
        """The one change to make to ``model`` now. ``room``, asked only when a start is due, says why one
        more instance cannot start now (a skip reason), or None when it can."""
        now = self._clock()
        self._wakes.pop(model, None)
        live = load.ready + load.starting
        spare = load.queued == 0 and load.ready > 0 and load.running <= (load.ready - 1) * load.capacity
        if not spare:
            self._spare_since.pop(model, None)
        if load.starting:
            return NOTHING
        if live < policy.min:
            return self._start(model, "min", room)
        if live > policy.max:
            return self._drain(model, "max", now)
        if load.queued and live == 0 and policy.max > 0:  # max 0: remote pools serve it, nothing starts here
            return self._start(model, "demand", room)
        scales = policy.max > policy.min  # a fixed count (--instances N) never scales up, so never skips either
        if scales and load.queued and load.oldest_wait >= policy.scale_up_after:
            if live >= policy.max:
                return self._skip(model, "at_max")
            return self._start(model, "queue", room)
        self._skipped.pop(model, None)
        if scales and load.queued:
            self._wakes[model] = now + policy.scale_up_after - load.oldest_wait
        if spare and live > policy.min:
            since = self._spare_since.setdefault(model, now)
            if now - since >= policy.scale_down_after:
                return self._drain(model, "idle", now)
            self._wakes[model] = since + policy.scale_down_after
        return NOTHING

    def next_wake(self) -> float | None:
        """The earliest time a decision may change with nothing else happening (a wait or an idle period
        running out), for the caller's poll timeout."""
        return min(self._wakes.values(), default=None)

    def forget(self, model: str) -> None:
        """Start ``model``'s timers afresh (its bounds changed)."""
        for table in (self._spare_since, self._skipped, self._wakes):
            table.pop(model, None)

    def _start(self, model: str, reason: str, room: Callable[[], str | None]) -> Decision:
        refused = room()
        if refused is not None:
            return self._skip(model, refused)
        self._skipped.pop(model, None)
        return Decision(Action.START, reason)

    def _drain(self, model: str, reason: str, now: float) -> Decision:
        self._spare_since[model] = now  # the next drain waits a whole period again
        return Decision(Action.DRAIN, reason)

    def _skip(self, model: str, reason: str) -> Decision:
        if self._skipped.get(model) == reason:
            return NOTHING
        self._skipped[model] = reason
        return Decision(Action.SKIP, reason)
