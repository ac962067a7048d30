"""The scaling decision with an injected clock: start on a queue older than scale_up_after when one more fits,
drain after scale_down_after of spare capacity, never outside min..max, one start in flight at most."""

from __future__ import annotations

import pytest

from mpserve.server.scaling import NOTHING, Action, Decision, Load, Policy, Scaler

pytestmark = pytest.mark.timeout(10)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def load(queued: int = 0, wait: float = 0.0, running: int = 0, ready: int = 1, starting: int = 0,
         capacity: int = 1) -> Load:
    return Load(queued, wait, running, ready, starting, capacity)


POLICY = Policy(min=1, max=3, scale_up_after=2.0, scale_down_after=10.0)


def fits() -> str | None:
    return None


def never() -> str | None:
    return "does_not_fit"


def test_a_queue_older_than_scale_up_after_starts_one_instance() -> None:
    scaler = Scaler(Clock())
    assert scaler.decide("m", load(queued=5, wait=1.9, running=1), POLICY, fits) == NOTHING
    assert scaler.decide("m", load(queued=5, wait=2.0, running=1), POLICY, fits) == Decision(Action.START, "queue")


def test_at_most_one_start_is_in_flight() -> None:
    scaler = Scaler(Clock())
    assert scaler.decide("m", load(queued=9, wait=5.0, running=1, starting=1), POLICY, fits) == NOTHING


def test_never_above_max_and_the_skip_is_reported_once() -> None:
    scaler = Scaler(Clock())
    busy = load(queued=9, wait=5.0, running=3, ready=3)
    assert scaler.decide("m", busy, POLICY, fits) == Decision(Action.SKIP, "at_max")
    assert scaler.decide("m", busy, POLICY, fits) == NOTHING
    assert scaler.decide("m", load(ready=3, running=3), POLICY, fits) == NOTHING  # the episode ends
    assert scaler.decide("m", busy, POLICY, fits) == Decision(Action.SKIP, "at_max")


def test_a_fixed_count_never_skips_a_scale_up_it_was_never_going_to_make() -> None:
    scaler = Scaler(Clock())
    fixed = Policy(min=2, max=2, scale_up_after=2.0, scale_down_after=10.0)
    assert scaler.decide("m", load(queued=9, wait=5.0, running=2, ready=2), fixed, fits) == NOTHING
    assert scaler.next_wake() is None  # nothing to wake for: the queue drains as its instances free


def test_a_start_that_does_not_fit_is_skipped_and_happens_once_it_fits() -> None:
    scaler = Scaler(Clock())
    waiting = load(queued=2, wait=3.0, running=1)
    assert scaler.decide("m", waiting, POLICY, never) == Decision(Action.SKIP, "does_not_fit")
    assert scaler.decide("m", waiting, POLICY, never) == NOTHING
    assert scaler.decide("m", waiting, POLICY, fits) == Decision(Action.START, "queue")


def test_a_skip_after_a_start_is_reported_again() -> None:
    scaler = Scaler(Clock())
    waiting = load(queued=2, wait=3.0, running=1)
    assert scaler.decide("m", waiting, POLICY, never) == Decision(Action.SKIP, "does_not_fit")
    assert scaler.decide("m", waiting, POLICY, fits) == Decision(Action.START, "queue")
    assert scaler.decide("m", load(queued=2, wait=3.0, running=2, ready=2), POLICY, never) == Decision(
        Action.SKIP, "does_not_fit")  # a new episode


@pytest.mark.parametrize("policy, busy, reason", [
    (POLICY, load(ready=0), "min"),
    (Policy(min=0, max=2, scale_up_after=30.0, scale_down_after=10.0), load(queued=1, ready=0), "demand"),
    (POLICY, load(queued=2, wait=3.0, running=1), "queue"),
])
def test_each_model_reports_its_own_skip_once(policy: Policy, busy: Load, reason: str) -> None:
    scaler = Scaler(Clock())
    for told in (Decision(Action.SKIP, "does_not_fit"), NOTHING):
        assert [scaler.decide(model, busy, policy, never) for model in ("a", "b")] == [told, told], reason
    assert [scaler.decide(model, busy, policy, fits) for model in ("a", "b")] == [Decision(Action.START, reason)] * 2


def test_forgetting_a_model_starts_its_skips_wakes_and_idle_period_afresh() -> None:
    clock = Clock()
    scaler = Scaler(clock)
    waiting = load(queued=2, wait=3.0, running=1)
    assert scaler.decide("m", waiting, POLICY, never) == Decision(Action.SKIP, "does_not_fit")
    scaler.forget("m")
    assert scaler.decide("m", waiting, POLICY, never) == Decision(Action.SKIP, "does_not_fit")  # told again
    three = load(ready=3, running=2)
    assert scaler.decide("m", three, POLICY, fits) == NOTHING  # spare from now
    clock.now += 9.0
    scaler.forget("m")
    assert scaler.next_wake() is None
    clock.now += 1.0
    assert scaler.decide("m", three, POLICY, fits) == NOTHING  # the idle period starts again at this decision
    clock.now += 10.0
    assert scaler.decide("m", three, POLICY, fits) == Decision(Action.DRAIN, "idle")


def test_a_wait_that_ended_leaves_no_wake() -> None:
    scaler = Scaler(Clock())
    assert scaler.decide("m", load(queued=1, wait=0.5, running=1), POLICY, fits) == NOTHING
    assert scaler.next_wake() is not None
    assert scaler.decide("m", load(running=1), POLICY, fits) == NOTHING
    assert scaler.next_wake() is None


def test_below_min_starts_and_above_max_drains() -> None:
    scaler = Scaler(Clock())
    assert scaler.decide("m", load(ready=0), POLICY, fits) == Decision(Action.START, "min")
    assert scaler.decide("m", load(ready=4), POLICY, fits) == Decision(Action.DRAIN, "max")


def test_a_drain_for_max_starts_the_idle_period_afresh() -> None:
    clock = Clock()
    scaler = Scaler(clock)
    assert scaler.decide("m", load(ready=4), POLICY, fits) == Decision(Action.DRAIN, "max")
    clock.now += 5.0
    assert scaler.decide("m", load(ready=3), POLICY, fits) == NOTHING
    clock.now += 5.0
    assert scaler.decide("m", load(ready=3), POLICY, fits) == Decision(Action.DRAIN, "idle")  # a period after it


def test_a_model_that_may_scale_to_zero_drains_its_last_idle_instance() -> None:
    clock = Clock()
    scaler = Scaler(clock)
    zero = Policy(min=0, max=2, scale_up_after=30.0, scale_down_after=10.0)
    assert scaler.decide("m", load(ready=1), zero, fits) == NOTHING
    clock.now += 10.0
    assert scaler.decide("m", load(ready=1), zero, fits) == Decision(Action.DRAIN, "idle")


def test_from_zero_a_request_starts_an_instance_at_once() -> None:
    scaler = Scaler(Clock())
    zero = Policy(min=0, max=2, scale_up_after=30.0, scale_down_after=10.0)
    assert scaler.decide("m", load(ready=0), zero, fits) == NOTHING
    assert scaler.decide("m", load(queued=1, ready=0), zero, fits) == Decision(Action.START, "demand")


def test_a_model_of_no_local_instance_neither_starts_nor_skips_for_a_queue() -> None:
    scaler = Scaler(Clock())  # --instances 0: remote pools serve it (issue 58: each queue logged a skip, "draining")
    none = Policy(min=0, max=0, scale_up_after=2.0, scale_down_after=10.0)
    assert scaler.decide("m", load(queued=3, wait=60.0, ready=0), none, lambda: "draining") == NOTHING


def test_spare_capacity_for_scale_down_after_drains_one_then_waits_a_period_again() -> None:
    clock = Clock()
    scaler = Scaler(clock)
    three = load(ready=3, running=2)  # one instance's worth idle
    assert scaler.decide("m", three, POLICY, fits) == NOTHING
    assert scaler.next_wake() == clock.now + 10.0
    clock.now += 9.9
    assert scaler.decide("m", three, POLICY, fits) == NOTHING
    clock.now += 0.1
    assert scaler.decide("m", three, POLICY, fits) == Decision(Action.DRAIN, "idle")
    clock.now += 5.0
    assert scaler.decide("m", load(ready=2), POLICY, fits) == NOTHING
    clock.now += 5.0
    assert scaler.decide("m", load(ready=2), POLICY, fits) == Decision(Action.DRAIN, "idle")
    clock.now += 100.0
    assert scaler.decide("m", load(ready=1), POLICY, fits) == NOTHING  # never below min


def test_a_busy_moment_restarts_the_idle_period() -> None:
    clock = Clock()
    scaler = Scaler(clock)
    assert scaler.decide("m", load(ready=2), POLICY, fits) == NOTHING
    clock.now += 8.0
    assert scaler.decide("m", load(ready=2, running=2), POLICY, fits) == NOTHING  # both busy: not spare
    clock.now += 8.0
    assert scaler.decide("m", load(ready=2), POLICY, fits) == NOTHING
    clock.now += 10.0
    assert scaler.decide("m", load(ready=2), POLICY, fits) == Decision(Action.DRAIN, "idle")


def test_parallel_slots_count_as_capacity() -> None:
    clock = Clock()
    scaler = Scaler(clock)
    assert scaler.decide("m", load(ready=2, running=3, capacity=2), POLICY, fits) == NOTHING
    clock.now += 20.0
    assert scaler.decide("m", load(ready=2, running=3, capacity=2), POLICY, fits) == NOTHING  # 3 > 1 × 2
    assert scaler.decide("m", load(ready=2, running=2, capacity=2), POLICY, fits) == NOTHING
    clock.now += 10.0
    assert scaler.decide("m", load(ready=2, running=2, capacity=2), POLICY, fits) == Decision(Action.DRAIN, "idle")


def test_models_are_decided_apart_and_the_wake_is_the_nearest_wait() -> None:
    clock = Clock()
    scaler = Scaler(clock)
    assert scaler.decide("a", load(queued=1, wait=0.5, running=1), POLICY, fits) == NOTHING
    assert scaler.decide("b", load(ready=2), POLICY, fits) == NOTHING
    assert scaler.next_wake() == clock.now + 1.5


def test_metrics_carry_bounds_and_scale_events_by_reason_through_the_wire() -> None:
    from mpserve.gateway.ops.metrics import GatewayMetrics, ServerView
    from mpserve.wire import protocol as wire

    scaling = wire.ModelScaling(1, 3, 4, starting=1, events={"start_queue": 2, "stop_idle": 1,
                                                              "skip_does_not_fit": 5})
    stats = wire.decode(wire.encode(wire.Stats(0, True, {}, {"m": wire.ModelStats(0, 0, 2, 2, scaling=scaling)})))
    text = GatewayMetrics().render(ServerView(stats, None, {}, None)).decode()
    for line in ('mpserve_instances_min{model="m"} 1.0', 'mpserve_instances_max{model="m"} 3.0',
                 'mpserve_instances_starting{model="m"} 1.0', 'mpserve_instances_draining{model="m"} 0.0',
                 'mpserve_registered_instances{model="m"} 2.0',
                 'mpserve_scale_starts_total{model="m",reason="queue"} 2.0',
                 'mpserve_scale_stops_total{model="m",reason="idle"} 1.0',
                 'mpserve_scale_skipped_total{model="m",reason="does_not_fit"} 5.0'):
        assert line in text.splitlines(), line


def test_a_model_scaled_to_zero_counts_as_able_to_serve_for_health() -> None:
    from mpserve.gateway.ops.monitor import health
    from mpserve.wire import protocol as wire

    def stats(low: int, high: int) -> wire.Stats:
        return wire.Stats(0, True, {}, {"m": wire.ModelStats(0, 0, 0, 0, scaling=wire.ModelScaling(low, high, 2))})

    assert health(stats(0, 2), [])["m"].can_serve and health(stats(0, 2), None)["m"].can_serve
    assert not health(stats(1, 2), [])["m"].can_serve  # its min instance is not ready yet
