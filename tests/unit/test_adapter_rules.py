"""The pure rules of LoRA adapters: which set's sequences run a step (``Turns``), the request's field and its
limits, and the label a slot row shows."""

from __future__ import annotations

import pytest

from mpserve.engine.adapters import Turns
from mpserve.errors import BadRequest
from mpserve.wire import protocol as wire
from mpserve.wire.slots import ADAPTER_LABEL_BYTES, adapter_label

A = (("a", 1.0),)
B = (("b", 0.5),)
AB = (("a", 1.0), ("b", 1.0))


def test_sets_with_work_take_turns_round_robin_and_one_set_runs_every_step() -> None:
    turns = Turns(steps=1)
    assert [turns.next([(), A, A]) for _ in range(4)] == [(), A, (), A]
    assert [turns.next([B, (), A, AB]) for _ in range(5)] == [AB, B, (), A, AB]  # after A's turn: the next in order
    assert [turns.next([A]) for _ in range(3)] == [A, A, A]
    assert [turns.next([A, B]) for _ in range(3)] == [B, A, B]


def test_a_set_keeps_its_turn_for_several_steps_while_others_wait() -> None:
    turns = Turns(steps=3)
    assert [turns.next([(), A]) for _ in range(8)] == [(), (), (), A, A, A, (), ()]
    assert [turns.next([A]) for _ in range(5)] == [A] * 5  # alone: no bound
    assert [turns.next([A, B]) for _ in range(4)] == [B, B, B, A]  # A ran 5 steps: B's turn at once


def test_a_turn_goes_on_after_steps_with_nothing_running() -> None:
    turns = Turns(steps=2)
    assert turns.next([A, B]) == A
    assert turns.next([]) == ()  # no turn
    assert [turns.next([A, B]) for _ in range(3)] == [A, B, B]


def test_a_set_arriving_waits_at_most_one_turn_of_each_other_set() -> None:
    turns, runs = Turns(steps=2), []
    for step in range(16):
        sets = [(), A] + ([B] if step >= 5 else [])
        runs.append(turns.next(sets))
    after = runs[5:]
    assert B in after[:2 * 2 + 1] and all(after.count(s) >= 2 for s in ((), A, B))


@pytest.mark.parametrize(("adapters", "words"), [
    ((("a", 4.5),), "each 'adapters' must be between -4.0 and 4.0, got 4.5"),
    ((("base:a", 1.0),), "each 'adapters' must match ^[A-Za-z0-9]"),
    (tuple((f"a{i}", 1.0) for i in range(wire.MAX_ADAPTERS + 1)), "'adapters' must hold at most 8 items, got 9"),
    ((("a", 1.0), ("a", 0.5)), "'adapters' names an adapter twice (a, a); give each once, with its scale"),
])
def test_a_request_s_adapters_out_of_their_limits_are_refused_naming_them(
        adapters: tuple[tuple[str, float], ...], words: str) -> None:
    with pytest.raises(BadRequest) as refused:
        wire.Request("r", "p", adapters=adapters).validate()
    assert words in refused.value.message


def test_a_request_s_adapters_cross_the_wire() -> None:
    request = wire.Request("r", "p", adapters=(("a", -4.0), ("b-2.x", 0.25)))
    assert wire.decode_as(wire.Request, wire.pack(request)) == request


def test_a_slot_row_labels_its_sets_canonically_and_cuts_long_ones() -> None:
    assert adapter_label(()) == ""
    assert adapter_label((("b", 0.5), ("a", 1.0), ("z", 0.0))) == "a+b*0.5"
    long = adapter_label(tuple((f"adapter-{i}", 1.0) for i in range(8)))
    assert len(long) == ADAPTER_LABEL_BYTES and long.endswith("~")
