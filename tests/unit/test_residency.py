"""Single active backend's turns (mpserve.server.residency): who holds a device, when it drains, who is next."""

from __future__ import annotations

import logging

import pytest

from mpserve.server.residency import Loaded, Residency

pytestmark = pytest.mark.timeout(10)


def test_the_first_model_with_waiting_requests_becomes_resident_when_nothing_is_loaded() -> None:
    r = Residency(batch=2)
    assert not r.allows(0, "a")
    assert r.decide(0, ["a", "b"], {}, []) == []
    assert r.allows(0, "a") and not r.allows(0, "b")


def test_the_resident_keeps_the_device_while_nobody_else_waits() -> None:
    r = Residency(batch=2)
    r.decide(0, ["a"], {}, [])
    for _ in range(5):
        r.started(0)
        assert r.decide(0, ["a"], {"a": 1}, [Loaded(b"wa", "a", False)]) == []
    assert r.allows(0, "a")


def test_after_batch_requests_the_resident_drains_then_unloads_then_the_next_model_gets_the_device() -> None:
    r = Residency(batch=2)
    r.decide(0, ["a"], {}, [])
    r.started(0)
    r.started(0)
    loaded = [Loaded(b"wa", "a", False)]
    assert r.decide(0, ["a", "b"], {"a": 1}, loaded) == []  # a still runs one: drain, nothing new starts
    assert not r.allows(0, "a") and not r.allows(0, "b")
    assert r.decide(0, ["a", "b"], {}, loaded) == [b"wa"]  # a is done: tell its worker to unload
    assert r.decide(0, ["a", "b"], {}, [Loaded(b"wa", "a", True)]) == []  # unloading: asked once only
    assert r.swaps == 0  # a's first turn is no swap
    assert r.decide(0, ["a", "b"], {}, []) == []  # unloaded: b is resident
    assert r.allows(0, "b") and not r.allows(0, "a") and r.swaps == 1


def test_a_resident_with_more_free_slots_than_its_batch_starts_only_its_batch_while_another_waits() -> None:
    """The broker fills every free slot between two ``decide`` calls: a resident given the device while another
    model waits must stop at its batch within that pass, not at the next decide."""
    r = Residency(batch=1)
    r.decide(0, ["a", "b"], {}, [])  # a is resident; b waits
    assert r.allows(0, "a")
    r.started(0)
    assert not r.allows(0, "a")  # a second free slot of a stays free: b is next
    assert r.decide(0, ["a", "b"], {"a": 1}, [Loaded(b"wa", "a", False)]) == []  # the drain
    assert not r.allows(0, "a") and not r.allows(0, "b")


def test_a_resident_nobody_else_waits_for_fills_its_free_slots_past_its_batch() -> None:
    r = Residency(batch=1)
    r.decide(0, ["a"], {}, [])
    for _ in range(3):
        assert r.allows(0, "a")
        r.started(0)


def test_each_turn_is_logged_once_the_drain_and_the_switch(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mpserve.residency")
    r = Residency(batch=1)
    r.decide(0, ["a"], {}, [])
    r.started(0)
    for _ in range(3):  # the drain is decided once, however often the broker asks
        r.decide(0, ["a", "b"], {"a": 1}, [Loaded(b"wa", "a", False)])
    r.decide(0, ["b"], {}, [])
    assert [rec.getMessage() for rec in caplog.records] == [
        "device 0: a is resident now",
        "device 0: a drains after 1 request(s) for b, which has requests waiting",
        "device 0: b is resident now (after a)",
    ]


def test_a_resident_with_an_empty_queue_hands_over_at_once_whatever_its_count() -> None:
    r = Residency(batch=100)
    r.decide(0, ["a"], {}, [])
    assert r.decide(0, ["b"], {}, [Loaded(b"wa", "a", False)]) == [b"wa"]


def test_devices_take_turns_independently() -> None:
    r = Residency(batch=1)
    r.decide(0, ["a"], {}, [])
    r.decide(1, ["b"], {}, [])
    assert r.allows(0, "a") and r.allows(1, "b") and not r.allows(1, "a")
