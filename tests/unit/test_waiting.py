"""The server loop's wait: busy polling after a message while the host has CPU to spare, blocking otherwise."""

from __future__ import annotations

from typing import Any

import pytest

from mpserve.server.waiting import GUARD_S, HIT_WAITS, Waiter

pytestmark = pytest.mark.timeout(10)

EVENT = [("sock", 1)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Poller:
    """Answers poll(0) with nothing until ``empty_polls`` have passed, then with an event; a blocking poll with an
    event, or (``times_out``) with nothing after its timeout. Each call moves the clock by ``step``. Records
    every timeout it was called with."""

    def __init__(self, clock: Clock, empty_polls: int = 0, step: float = 0.0, times_out: bool = False) -> None:
        self.clock, self.empty_polls, self.step, self.times_out = clock, empty_polls, step, times_out
        self.timeouts: list[int | None] = []

    def poll(self, timeout: int | None = None, /) -> list[tuple[Any, int]]:
        self.timeouts.append(timeout)
        self.clock.now += self.step
        if timeout == 0 and self.empty_polls > 0:
            self.empty_polls -= 1
            return []
        if timeout != 0 and self.times_out:
            self.clock.now += timeout / 1000 if timeout else 0
            return []
        return EVENT


class Idle:
    """The host's idle CPU seconds: ``per_s`` CPUs idle as the clock goes (``per_s`` may change)."""

    def __init__(self, clock: Clock, per_s: float) -> None:
        self.clock, self.per_s = clock, per_s
        self._total, self._at = 0.0, clock.now

    def __call__(self) -> tuple[float, ...]:
        self._total += (self.clock.now - self._at) * self.per_s
        self._at = self.clock.now
        return (self._total,)


def _after_a_message(waiter: Waiter, clock: Clock) -> None:
    """A message, then a guard interval later a wait that finds nothing at once (the guard looks at the host
    then) and gets another."""
    assert waiter.wait(Poller(clock), 1000) == dict(EVENT)
    clock.now += GUARD_S
    assert waiter.wait(Poller(clock, empty_polls=1), 1000) == dict(EVENT)


def _polling_waiter() -> tuple[Clock, Waiter]:
    """A waiter with 250 µs of busy polling on a host with 1.5 CPUs idle, past its first guard: polling on."""
    clock = Clock()
    waiter = Waiter(250e-6, Idle(clock, 1.5), clock)
    _after_a_message(waiter, clock)
    assert waiter.polling_allowed
    return clock, waiter


def test_with_busy_poll_off_a_wait_blocks_at_once() -> None:
    clock = Clock()
    poller = Poller(clock, empty_polls=1)
    assert Waiter(0.0, Idle(clock, 2.0), clock).wait(poller, 50) == dict(EVENT)
    assert poller.timeouts == [0, 50]


def test_after_a_message_it_polls_without_sleeping_while_a_cpu_is_idle() -> None:
    clock, waiter = _polling_waiter()
    poller = Poller(clock, empty_polls=5, step=10e-6)
    assert waiter.wait(poller, 1000) == dict(EVENT)
    assert poller.timeouts == [0] * 6  # the event came while polling: no blocking call


def test_it_blocks_when_no_cpu_was_idle() -> None:
    clock = Clock()
    waiter = Waiter(250e-6, Idle(clock, 0.1), clock)
    _after_a_message(waiter, clock)
    assert not waiter.polling_allowed
    poller = Poller(clock, empty_polls=5, step=10e-6)
    waiter.wait(poller, 1000)
    assert poller.timeouts == [0, 1000]


def test_polling_stops_busy_poll_after_the_loop_ran_out_of_work_and_then_blocks() -> None:
    clock = Clock()
    waiter = Waiter(250e-6, Idle(clock, 1.5), clock)
    _after_a_message(waiter, clock)
    poller = Poller(clock, empty_polls=1000, step=10e-6)
    waiter.wait(poller, 1000)
    assert poller.timeouts[-1] == 1000
    assert 20 <= poller.timeouts.count(0) <= 27  # 250 µs of 10 µs polls


def test_the_window_opens_when_the_loop_runs_out_of_work_not_again_after_a_wait_in_vain() -> None:
    clock = Clock()
    waiter = Waiter(250e-6, Idle(clock, 1.5), clock)
    _after_a_message(waiter, clock)
    clock.now += 1.0  # a long turn: the window opens when it ends
    poller = Poller(clock, empty_polls=1000, step=10e-6, times_out=True)
    assert waiter.wait(poller, 1000) == {}
    assert poller.timeouts[-1] == 1000 and 20 <= poller.timeouts.count(0) <= 27
    poller = Poller(clock, empty_polls=5, step=10e-6)
    waiter.wait(poller, 1000)  # nothing came since: no window
    assert poller.timeouts == [0, 1000]


def test_the_time_spent_polling_counts_as_idle() -> None:
    """Nothing else idles, but the poll loop itself took the CPU: polling must not switch itself off."""
    clock = Clock()
    idle = Idle(clock, 1.5)
    waiter = Waiter(GUARD_S, idle, clock)
    _after_a_message(waiter, clock)
    assert waiter.polling_allowed
    idle.per_s = 0.0  # from here no CPU idles but the one polling
    polls = Poller(clock, empty_polls=200, step=1e-3)
    waiter.wait(polls, 10_000)  # most of a guard interval polling, and then a message
    assert polls.timeouts == [0] * 201
    clock.now += 0.01
    waiter.wait(Poller(clock, empty_polls=1), 1000)
    assert waiter.polling_allowed


def test_polling_stops_where_messages_come_later_than_busy_poll_and_resumes_where_they_come_sooner() -> None:
    """Counted from blocking waits too: how far apart messages come decides, with polling on or off."""
    clock, waiter = _polling_waiter()
    for _ in range(10):  # messages 1 ms apart: each wait polls 250 µs in vain, then blocks
        polls = Poller(clock, empty_polls=1000, step=10e-6)
        waiter.wait(polls, 1000)
        clock.now += 1e-3
    clock.now += GUARD_S
    waiter.wait(Poller(clock, empty_polls=1), 1000)
    assert not waiter.polling_allowed
    for _ in range(10):  # messages 100 µs apart, each wait blocking
        polls = Poller(clock, empty_polls=1, step=100e-6)
        waiter.wait(polls, 1000)
        assert polls.timeouts == [0, 1000]
    clock.now += GUARD_S
    waiter.wait(Poller(clock, empty_polls=1), 1000)
    assert waiter.polling_allowed


def test_polling_that_stops_paying_stops_after_hit_waits_waits_not_a_guard_interval() -> None:
    clock, waiter = _polling_waiter()
    started = clock.now
    for _ in range(HIT_WAITS):  # each polls 250 µs in vain; the message comes after 1 ms
        waiter.wait(Poller(clock, empty_polls=1000, step=10e-6), 1000)
        clock.now += 1e-3
    assert clock.now - started < GUARD_S
    assert not waiter.polling_allowed


def test_the_least_idle_source_decides() -> None:
    """The CPUs idle, but the cgroup's quota is used up: no polling."""
    clock = Clock()
    cpus, quota = Idle(clock, 1.5), Idle(clock, 0.1)
    waiter = Waiter(250e-6, lambda: (*cpus(), *quota()), clock)
    _after_a_message(waiter, clock)
    assert not waiter.polling_allowed
    quota.per_s = 1.0
    clock.now += GUARD_S
    waiter.wait(Poller(clock, empty_polls=1), 1000)
    assert waiter.polling_allowed


def test_without_a_readable_stat_file_it_never_polls() -> None:
    clock = Clock()
    waiter = Waiter(250e-6, lambda: None, clock)
    _after_a_message(waiter, clock)
    assert not waiter.polling_allowed
