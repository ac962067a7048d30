"""The tenants' queue and ledger at their edges (``mpserve.server.tenants``): a ticket taken out of a line's middle,
the bands above a priority, a tenant's line, ties by arrival, a returning tenant's debt, the idle tenants forgotten;
each limit at its bound, retry_after to the hundredth, and every figure summed over several requests."""

from __future__ import annotations

import logging

import pytest

from mpserve.config.tenants import LOCAL, Tenant, Tenants
from mpserve.errors import Busy
from mpserve.server.tenants import WINDOW_S, FairQueue, Ledger, shown

pytestmark = pytest.mark.timeout(10)

KEY = "key:" + "c" * 16


def started(queue: FairQueue, count: int) -> list[str]:
    order = []
    for _ in range(count):
        ticket = queue.head()
        assert ticket is not None
        queue.pop(ticket)
        order.append(ticket)
    return order


def test_a_ticket_taken_from_the_middle_of_its_line_leaves_the_others_in_order() -> None:
    queue = FairQueue()
    for ticket in ("a1", "a2", "a3"):
        queue.append(ticket, "a")
    queue.remove("a2")
    assert list(queue.line("a", 0)) == ["a1", "a3"] and queue.waiting("a") == 2
    assert started(queue, 2) == ["a1", "a3"] and not queue


def test_a_line_is_a_tenant_s_tickets_of_one_priority_and_the_default_priority_is_0() -> None:
    queue = FairQueue()
    queue.append("a1", "a")
    queue.append("a2", "a")
    queue.append("h", "a", priority=3)
    queue.requeue("back", "a")  # put back: first in its band, not in the line
    assert list(queue.line("a", 0)) == ["a1", "a2"] and list(queue.line("a", 3)) == ["h"]
    assert list(queue.line("b", 0)) == [] and list(queue.line("a", 7)) == []
    assert queue.above(0) == ["h"]


def test_above_gives_the_higher_bands_highest_first_those_put_back_first_then_by_arrival() -> None:
    queue = FairQueue()
    assert queue.above(0) == []
    queue.append("z0", "a")
    queue.append("y1", "a", priority=1)
    queue.append("x2", "b", priority=2)
    queue.append("w1", "b", priority=1)
    queue.requeue("v1", "c", priority=1)
    assert queue.above(0) == ["x2", "v1", "y1", "w1"]
    assert queue.above(1) == ["x2"] and queue.above(2) == []


def test_the_head_looks_below_a_band_whose_tickets_may_not_start() -> None:
    queue = FairQueue()
    queue.requeue("passed", "a", priority=2)  # put back, its instance has no slot free
    queue.append("capped", "a", priority=1)  # its tenant may start no more
    queue.append("low", "b")
    assert queue.head(passed={"passed"}) == "capped"
    assert queue.head(lambda tenant: tenant != "a", passed={"passed"}) == "low"


def test_a_ticket_put_back_starts_first_and_of_equal_finishes_the_earliest_not_the_first_by_name() -> None:
    queue = FairQueue()
    queue.append("new", "a")
    queue.requeue("back", "a")
    assert queue.head() == "back"
    arrivals = FairQueue()
    arrivals.append("z", "b")
    arrivals.append("a", "a")
    assert arrivals.head() == "z"


def test_a_tenant_that_waits_again_keeps_what_it_used_beyond_its_share() -> None:
    queue = FairQueue()
    queue.append("a1", "a")
    assert started(queue, 1) == ["a1"]
    queue.charge("a", 10.0)  # a's request held its slot 11 times its cost
    queue.append("a2", "a")  # a waits again, before b
    queue.append("b1", "b")
    assert queue.head() == "b1"


def test_a_charge_counts_against_the_tenant_s_weight() -> None:
    weights = {"a": 2.0, "b": 1.0}
    queue = FairQueue(weights.__getitem__)
    for tenant in weights:
        for i in range(4):
            queue.append(f"{tenant}{i}", tenant)
    assert sorted(started(queue, 2)) == ["a0", "b0"]
    queue.charge("a", 2.0)  # 2 s more at weight 2: a's finish moves 1 further, b's next goes first
    assert started(queue, 2) == ["b1", "a1"]


def test_idle_tenants_are_forgotten_but_a_debt_and_the_waiting_tenants_are_kept() -> None:
    queue = FairQueue()
    queue.append("heavy", "heavy")
    queue.pop("heavy")
    queue.charge("heavy", 1000.0)  # far ahead of the clock
    for i in range(70):  # more tenants than the queue remembers while so few wait
        queue.append(f"t{i}", f"t{i}")
        queue.pop(f"t{i}")
    queue.append("w1", "w")
    queue.append("w2", "w")
    queue.pop("w1")
    queue.append("z", "z")  # begins to wait at the clock
    queue.pop("w2")  # the clock passes the idle tenants' finish: they are forgotten, z waits on
    assert queue.head() == "z"
    queue.pop("z")
    queue.append("back", "heavy")
    queue.append("light", "light")
    assert queue.head() == "light"  # heavy's debt outlived the forgetting


def test_shown_names_the_local_tenant() -> None:
    assert shown(LOCAL) == "local" and shown(KEY) == KEY


def test_limited_may_start_weight_and_running_read_each_tenant_s_own_settings() -> None:
    ledger = Ledger(Tenants({KEY: Tenant(weight=3.0, max_queued=2), "key:" + "d" * 16: Tenant(tokens_per_minute=9),
                             "key:" + "e" * 16: Tenant(max_running=2)}))
    assert ledger.limited(KEY) and ledger.limited("key:" + "d" * 16)
    assert not ledger.limited("key:" + "e" * 16) and not ledger.limited(LOCAL)
    assert ledger.weight(KEY) == 3.0 and ledger.weight(LOCAL) == 1.0
    assert ledger.running("key:" + "f" * 16) == 0
    capped = "key:" + "e" * 16
    ledger.started(capped, 0.0)
    assert ledger.may_start(capped) and not ledger.may_start(capped, 2)
    ledger.started(capped, 0.0)
    assert not ledger.may_start(capped)


def test_a_refusal_over_max_queued_names_the_limits_it_has_and_counts_once_each() -> None:
    ledger = Ledger(Tenants({KEY: Tenant(max_queued=1)}))
    for _ in range(2):
        with pytest.raises(Busy) as refused:
            ledger.admit(KEY, 1, True, 0.0)
    assert refused.value.message == (f"tenant {KEY} has 1 request queued, its max_queued (1), and 0 running; retry "
                                     "once some have finished")
    assert refused.value.retry_after == 1.0
    assert ledger.figures(lambda tenant: 0)[KEY].refusals == 2


def test_the_window_frees_tokens_at_exactly_60_s_and_retry_after_is_when_enough_have_left() -> None:
    ledger = Ledger(Tenants({KEY: Tenant(tokens_per_minute=40)}))
    ledger.used(KEY, 20, 0, 0.0)
    ledger.used(KEY, 20, 0, 10.0)
    ledger.used(KEY, 40, 0, 20.5)
    with pytest.raises(Busy) as refused:
        ledger.admit(KEY, 0, False, 30.1234)
    assert refused.value.retry_after == round(20.5 + WINDOW_S - 30.1234, 2) == 50.38  # 40 left is not below 40
    with pytest.raises(Busy) as refused:
        ledger.admit(KEY, 0, False, 60.0)  # the first 20 left the window at 60.0 exactly: 60 of 40 are in it
    assert refused.value.retry_after == 20.5 and "used 60 tokens" in refused.value.message
    with pytest.raises(Busy) as refused:
        ledger.admit(KEY, 0, False, 80.0)
    assert refused.value.retry_after == 0.5
    ledger.admit(KEY, 0, False, 80.5)  # 0 left
    assert ledger.figures(lambda tenant: 0)[KEY].refusals == 3


def test_a_window_that_leaves_by_one_entry_at_a_time_keeps_the_rest() -> None:
    ledger = Ledger(Tenants({KEY: Tenant(tokens_per_minute=20)}))
    ledger.used(KEY, 30, 0, 0.0)
    ledger.used(KEY, 10, 0, 30.0)
    ledger.admit(KEY, 0, False, 61.0)  # 10 of 20 are in the window


def test_figures_sum_every_request_of_a_tenant_and_read_its_queue() -> None:
    ledger = Ledger(None)
    queued = {KEY: 3, LOCAL: 1}
    ledger.accepted(KEY)
    for queued_s in (1.5, 0.2346):
        ledger.started(KEY, queued_s)
    ledger.used(KEY, 10, 5, 0.0)
    ledger.used(KEY, 7, 2, 1.0)
    ledger.preempted(KEY)
    ledger.preempted(KEY)
    ledger.started(LOCAL, 0.0)
    row = ledger.figures(queued.__getitem__)[KEY]
    assert (row.prompt_tokens, row.generated_tokens, row.queue_s, row.preemptions, row.running, row.queued) == (
        17, 7, 1.735, 2, 2, 3)
    assert ledger.figures(queued.__getitem__)["local"].queued == 1


def test_a_tenant_s_own_figures_are_its_row_alone_and_none_before_its_first_request() -> None:
    ledger = Ledger(None)
    assert ledger.own_figures(KEY, lambda tenant: 0) == {}
    ledger.accepted(KEY)
    ledger.accepted(LOCAL)
    ledger.started(KEY, 0.25)
    own = ledger.own_figures(KEY, {KEY: 4, LOCAL: 9}.__getitem__)
    assert list(own) == [KEY] and (own[KEY].requests, own[KEY].queue_s, own[KEY].queued) == (1, 0.25, 4)
    assert list(ledger.own_figures(LOCAL, lambda tenant: 0)) == ["local"]


def test_a_keyed_tenant_s_capped_priority_is_warned_in_full(caplog: pytest.LogCaptureFixture) -> None:
    ledger = Ledger(None)
    with caplog.at_level(logging.WARNING, logger="mpserve.server.tenants"):
        assert ledger.priority(KEY, 5) == 0
    assert caplog.messages == [f"tenant {KEY} asked for priority 5, lowered to 0: without a tenants section a tenant "
                               "other than the local one may ask for 0 at most; declare its max_priority in the "
                               "tenants section to allow more"]
