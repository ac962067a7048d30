"""The tenants' queue order (``FairQueue``), limits and figures (``Ledger``), and the ``tenants`` section."""

from __future__ import annotations

from collections import Counter

import pytest

from mpserve.config import loader as cfg
from mpserve.config.tenants import Tenant, Tenants, parse_tenants
from mpserve.errors import Busy, ConfigError
from mpserve.server.tenants import OTHER, TOP_TENANTS, WINDOW_S, FairQueue, Ledger

pytestmark = pytest.mark.timeout(10)

KEY_A = "key:" + "a" * 16
KEY_B = "key:" + "b" * 16


def _started(queue: FairQueue, count: int, eligible: object = None, tenant_of: dict[str, str] | None = None
             ) -> list[str]:
    """The tickets the queue starts, ``count`` of them, each charged its cost exactly."""
    order = []
    for _ in range(count):
        ticket = queue.head() if eligible is None else queue.head(eligible)  # type: ignore[arg-type]
        assert ticket is not None
        queue.pop(ticket)
        order.append(ticket)
    return order


def _fill(queue: FairQueue, tenant: str, count: int, priority: int = 0) -> None:
    for i in range(count):
        queue.append(f"{tenant}/{priority}/{i}", tenant, priority)


def test_a_tenant_of_weight_two_starts_twice_as_many_while_both_wait() -> None:
    weights = {"a": 1.0, "b": 2.0, "c": 4.0}
    queue = FairQueue(weights.__getitem__)
    for tenant in weights:
        _fill(queue, tenant, 70)
    started = Counter(t.split("/")[0] for t in _started(queue, 70))
    assert started == {"a": 10, "b": 20, "c": 40}


def test_within_a_tenant_requests_start_in_order_of_arrival() -> None:
    queue = FairQueue()
    _fill(queue, "a", 5)
    assert _started(queue, 5) == [f"a/0/{i}" for i in range(5)]


def test_the_slot_time_used_is_charged_not_the_number_of_requests() -> None:
    queue = FairQueue()
    _fill(queue, "a", 10)
    _fill(queue, "b", 10)
    first = _started(queue, 2)
    assert sorted(t[0] for t in first) == ["a", "b"]
    queue.charge("a", 3.0)  # a's request held its slot 4 times its cost: b's next three go first
    assert [t[0] for t in _started(queue, 4)] == ["b", "b", "b", "a"]


def test_an_idle_tenant_saves_no_credit_for_later() -> None:
    queue = FairQueue()
    _fill(queue, "a", 50)
    _started(queue, 40)  # b waited for nothing meanwhile: a had every slot
    _fill(queue, "b", 10)
    started = Counter(t[0] for t in _started(queue, 10))
    assert started == {"a": 5, "b": 5}  # b does not get its 40 back


def test_higher_priority_starts_first_whatever_the_shares() -> None:
    queue = FairQueue({"a": 100.0, "b": 1.0}.__getitem__)
    _fill(queue, "a", 3)
    _fill(queue, "b", 2, priority=5)
    assert [t[:3] for t in _started(queue, 5)] == ["b/5", "b/5", "a/0", "a/0", "a/0"]


def test_a_request_put_back_goes_first_in_its_band_and_is_not_charged_again() -> None:
    queue = FairQueue()
    _fill(queue, "a", 3)
    _fill(queue, "b", 3)
    queue.requeue("lost", "a", 0)
    queue.requeue("urgent-lost", "b", 5)
    assert queue.head() == "urgent-lost"
    assert _started(queue, 2) == ["urgent-lost", "lost"]
    assert sorted(t[0] for t in _started(queue, 2)) == ["a", "b"]  # a was not charged for "lost"


def test_a_tenant_that_may_not_start_is_passed_over_and_keeps_its_place() -> None:
    queue = FairQueue()
    _fill(queue, "a", 3)
    _fill(queue, "b", 3)
    assert [t[0] for t in _started(queue, 3, lambda tenant: tenant != "a")] == ["b", "b", "b"]
    assert queue.head(lambda tenant: tenant != "a") is None
    assert queue.head() == "a/0/0"


def test_removed_tickets_leave_every_count() -> None:
    queue = FairQueue()
    _fill(queue, "a", 2)
    queue.requeue("back", "a", 3)
    assert len(queue) == 3 and queue.waiting("a") == 3 and "back" in queue and queue.oldest() == "a/0/0"
    for ticket in queue:
        queue.remove(ticket)
    assert not queue and queue.waiting("a") == 0 and queue.head() is None


def test_max_queued_refuses_naming_the_limit_the_value_and_the_use() -> None:
    ledger = Ledger(Tenants({KEY_A: Tenant(max_running=2, max_queued=3)}))
    ledger.started(KEY_A, 0.0)
    ledger.started(KEY_A, 0.0)
    assert not ledger.may_start(KEY_A) and ledger.may_start(KEY_B)
    ledger.admit(KEY_A, 2, True, 0.0)  # the third may wait
    with pytest.raises(Busy, match=rf"tenant {KEY_A} has 3 requests queued, its max_queued \(3\), and 2 running, "
                                   "its max_running 2") as refused:
        ledger.admit(KEY_A, 3, True, 0.0)
    assert refused.value.retry_after
    ledger.admit(KEY_A, 3, False, 0.0)  # one that starts at once waits for nothing
    assert ledger.figures(lambda tenant: 0)[KEY_A].refusals == 1


def test_tokens_per_minute_counts_a_sliding_window_of_prompt_and_generated_tokens() -> None:
    ledger = Ledger(Tenants({KEY_A: Tenant(tokens_per_minute=100)}))
    ledger.used(KEY_A, 30, 30, now=0.0)
    ledger.admit(KEY_A, 0, False, now=1.0)
    ledger.used(KEY_A, 10, 30, now=10.0)
    with pytest.raises(Busy, match=r"used 100 tokens \(prompt and generated\) in the last 60 s, its "
                                   r"tokens_per_minute \(100\)") as refused:
        ledger.admit(KEY_A, 0, False, now=20.0)
    assert refused.value.retry_after == pytest.approx(WINDOW_S - 20.0)  # when the first 60 leave the window
    ledger.admit(KEY_A, 0, False, now=WINDOW_S + 0.5)
    ledger.admit(KEY_B, 0, False, now=20.0)  # another tenant has a window of its own


def test_priorities_are_capped_by_the_tenants_ceiling_a_keyed_one_at_0_without_a_section(
        caplog: pytest.LogCaptureFixture) -> None:
    unsectioned = Ledger(None)
    assert unsectioned.priority(KEY_A, 100) == 0 and unsectioned.priority(KEY_A, -5) == -5
    assert unsectioned.priority("", 100) == 100  # the local user (and a gateway without keys) may ask for any
    assert unsectioned.priority(KEY_A, 50) == 0 and unsectioned.priority(KEY_B, 1) == 0
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2 and f"tenant {KEY_A} asked for priority 100, lowered to 0" in warned[0]  # once a key
    assert "declare its max_priority in the tenants section" in warned[1]
    ledger = Ledger(parse_tenants({KEY_A: {"max_priority": 10}, "default": {}}))
    assert ledger.priority(KEY_A, 50) == 10 and ledger.priority(KEY_A, -5) == -5
    assert ledger.priority(KEY_B, 50) == 0  # the default ceiling of a declared section


def test_figures_name_the_busiest_tenants_and_sum_the_rest() -> None:
    ledger = Ledger(None)
    for i in range(TOP_TENANTS + 5):
        for _ in range(i + 1):
            ledger.accepted(f"key:{i:016x}")
    ledger.accepted("")
    figures = ledger.figures(lambda tenant: 1)
    assert len(figures) == TOP_TENANTS + 1 and f"key:{TOP_TENANTS + 4:016x}" in figures
    assert figures[OTHER].requests == 1 + 2 + 3 + 4 + 5 + 1 and figures[OTHER].queued == 6
    ledger.preempted(f"key:{TOP_TENANTS + 4:016x}")
    assert ledger.figures(lambda tenant: 0)[f"key:{TOP_TENANTS + 4:016x}"].preemptions == 1


def test_the_tenants_section_is_read_with_its_defaults() -> None:
    curve = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
    tenants = parse_tenants({KEY_A: {"weight": 4, "max_priority": 10, "max_running": 8, "max_queued": 0,
                                     "tokens_per_minute": 1000}, curve: None, "local": {"max_priority": 100},
                             "default": {"max_running": 2}})
    assert tenants.of(KEY_A) == Tenant(4.0, 10, 8, 0, 1000)
    assert tenants.of(curve) == Tenant(1.0, 0) and tenants.of("").max_priority == 100
    assert tenants.of(KEY_B) == Tenant(max_priority=0, max_running=2)
    assert cfg.build({"tenants": {KEY_A: {"weight": 2}}}).tenants == Tenants({KEY_A: Tenant(2.0, 0)},
                                                                             Tenant(max_priority=0))
    assert cfg.build({}).tenants is None


@pytest.mark.parametrize(("section", "words"), [
    ({"key:abc": {}}, "tenants.key:abc: not a tenant's name; name an API key by its digest"),
    ({KEY_A: {"weigth": 2}}, f"tenants.{KEY_A}: unknown key 'weigth'; allowed keys: weight, max_priority"),
    ({KEY_A: {"weight": 0}}, f"tenants.{KEY_A}.weight: got 0, allowed: a number from 0.01 to 1000"),
    ({KEY_A: {"max_priority": 101}}, f"tenants.{KEY_A}.max_priority: got 101, allowed: an integer from -100"),
    ({KEY_A: {"max_running": 0}}, f"tenants.{KEY_A}.max_running: got 0, allowed: an integer of at least 1"),
    ({KEY_A: {"max_queued": -1}}, f"tenants.{KEY_A}.max_queued: got -1, allowed: an integer of at least 0"),
    ({KEY_A: 3}, f"tenants.{KEY_A}: got 3, expected a mapping of weight"),
    ({"local": {}, "": {}}, "tenants.: the local user is declared twice"),
    ([KEY_A], "tenants: got ['key:aaaaaaaaaaaaaaaa'], expected a mapping"),
])
def test_a_bad_tenants_section_is_one_line_naming_the_entry(section: object, words: str) -> None:
    with pytest.raises(ConfigError) as refused:
        cfg.build({"tenants": section})
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_a_count_of_one_reads_in_the_singular() -> None:
    ledger = Ledger(Tenants({KEY_A: Tenant(max_running=1, max_queued=1)}))
    ledger.started(KEY_A, 0.0)
    ledger.admit(KEY_A, 0, True, 0.0)
    with pytest.raises(Busy, match=rf"tenant {KEY_A} has 1 request queued, its max_queued \(1\), and 1 running"):
        ledger.admit(KEY_A, 1, True, 0.0)
