"""How the server's loop waits for its sockets: first polling for a short while without sleeping, then
blocking.

    a turn ends ──▶ Waiter.wait(poller, timeout_ms)
        anything waiting?                        ──▶ return it
        the loop ran out of work less than busy_poll ago,
        and the guard allows it (below)          ──▶ poll without blocking until something comes or busy_poll
                                                     has passed since then
        still nothing                            ──▶ poll, blocking up to timeout_ms

    polling is allowed while both hold:
        every GUARD_S: the idle CPU time this process could have used (``cpu_idle``: its CPUs, its cgroup's
            quota) plus the time this loop spent polling, over the interval, was at least SPARE_CPUS
        every HIT_WAITS waits that began within a window (and every GUARD_S): in at least HIT_SHARE of them a
            message came within the window (counted whether the loop polled or blocked), so that polling
            that stopped paying stops within a few milliseconds under load

Why: a thread that blocks is put to sleep, and waking it takes longer than the broker's work on a message
(on a VM the idle CPU halts, and waking it is a round trip through the hypervisor). A request served alone
crosses the broker twice, so each wake-up is on its path. After the broker has handled a message the answer
or the next request often comes within busy_poll; polling catches it awake.

Polling spends a CPU, so it is done only where the server has CPU to spare: where the models' threads keep
every CPU it may use busy (a CPU-only host, or a container at its CPU limit) the guard finds none idle and
the loop blocks as before; where they do not (a GPU host, the echo backend) the broker keeps one CPU busy
while messages come and lets it go ``busy_poll`` after the last one. The polling time counts as idle in
the guard, or polling would switch itself off. Where messages come further apart than busy_poll (a
model's tokens, a loaded pool's steps) polling would only burn the CPU, and the second rule turns it off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from .cpu_idle import CpuIdle

log = logging.getLogger("mpserve.server")

GUARD_S = 0.25
SPARE_CPUS = 0.5  # idle CPUs, on average over GUARD_S, that allow polling
HIT_SHARE = 0.5  # and the share of waits in which a message came within the window,
HIT_WAITS = 32  # judged every this many waits that began within a window (and every GUARD_S)


class Pollable(Protocol):
    def poll(self, timeout: int | None = ..., /) -> list[tuple[Any, int]]: ...


class Waiter:
    """``busy_poll_s`` 0: every wait blocks at once."""

    def __init__(self, busy_poll_s: float, idle_s: Callable[[], tuple[float, ...] | None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """``idle_s``: running totals of idle CPU seconds (``CpuIdle.seconds``, read only with busy_poll_s)."""
        self._busy_s = busy_poll_s
        self._idle_s = idle_s if idle_s is not None or not busy_poll_s else CpuIdle().seconds
        self._clock = clock
        self._had_work = False  # the last wait found messages: the turn after it had work to do
        self._window_end = 0.0  # busy_poll after the loop last ran out of work
        self._allowed = False  # until the first interval has shown a spare CPU
        self._paying = True  # whether a message came within the window, in most waits lately
        self._spare: float | None = None  # idle CPUs the server could use, over the guard's last interval
        self._guard_from = clock()
        self._guard_idle = self._idle_s() if self._idle_s is not None else None
        self._polled_s = 0.0  # since the guard's last look: time spent polling,
        self._hits = 0  # waits that began within the window and got a message within it,
        self._misses = 0  # and those that did not

    @property
    def polling_allowed(self) -> bool:
        return self._allowed

    def wait(self, poller: Pollable, timeout_ms: int) -> dict[Any, int]:
        events = poller.poll(0)
        if not events and timeout_ms:
            events = self._poll_then_block(poller, timeout_ms) if self._busy_s else poller.poll(timeout_ms)
        self._had_work = bool(events)
        return dict(events)

    def _poll_then_block(self, poller: Pollable, timeout_ms: int) -> list[tuple[Any, int]]:
        now = self._clock()
        if now - self._guard_from >= GUARD_S:
            self._guard(now)
        if self._had_work:  # the loop has just run out of work: the window opens
            self._window_end = now + self._busy_s
        window_end = self._window_end
        in_window = now < window_end
        events: list[tuple[Any, int]] = []
        if self._allowed and in_window:
            started, until = now, min(window_end, now + timeout_ms / 1000)
            while not events and now < until:
                events = poller.poll(0)
                now = self._clock()
            self._polled_s += now - started
        if not events:
            events = poller.poll(timeout_ms)
            now = self._clock()
        if in_window:  # blocking or not, whether polling would have caught this message
            if events and now <= window_end:
                self._hits += 1
            else:
                self._misses += 1
            if self._hits + self._misses >= HIT_WAITS:
                self._judge_hits()
        return events

    def _guard(self, now: float) -> None:
        """Every GUARD_S: whether the CPU the server may use had enough idle (and the hits so far, if any)."""
        assert self._idle_s is not None
        idle, before = self._idle_s(), self._guard_idle
        spare = None if idle is None or before is None or len(idle) != len(before) else \
            (min(b - a for a, b in zip(before, idle, strict=True)) + self._polled_s) / (now - self._guard_from)
        self._spare = spare
        self._guard_from, self._guard_idle, self._polled_s = now, idle, 0.0
        if self._hits + self._misses:
            self._judge_hits()  # an interval without messages keeps the last verdict
        else:
            self._decide()

    def _judge_hits(self) -> None:
        """Every HIT_WAITS waits in a window (or at the guard's look): whether polling caught enough."""
        tried = self._hits + self._misses
        self._paying = self._hits >= HIT_SHARE * tried
        self._decide(tried)
        self._hits = self._misses = 0

    def _decide(self, tried: int = 0) -> None:
        spare = self._spare
        allowed = spare is not None and spare >= SPARE_CPUS and self._paying
        if allowed != self._allowed:  # the message is made only then: this runs every HIT_WAITS waits
            log.debug("busy polling %s: %s CPUs idle%s", "on" if allowed else "off",
                      "unknown" if spare is None else f"{spare:.2f}",
                      f", a message within {self._busy_s * 1e6:.0f} µs in {self._hits} of {tried} waits"
                      if tried else "")
        self._allowed = allowed
