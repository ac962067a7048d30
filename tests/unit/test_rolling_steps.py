"""A roll's decisions (``mpserve.server.rolling.step``) and the rows it takes (``rolling.allocate``): one change at
a time, a new instance started before an old one drains where there is room, drained first where there is none,
and done once as many new instances run as old ones did."""

from __future__ import annotations

from mpserve.server.rolling import Roll, Step, Turn, allocate, step, turn


def _play(target: int, slots: int) -> list[Step]:
    """A model of ``target`` instances rolled where ``slots`` indices exist (a start takes a free one, a drain
    frees one once its instance exits), each step's instance ready or gone by the next turn."""
    roll, old, new, steps = Roll(set(range(target)), target), target, 0, []
    while len(steps) < 20:
        action = step(roll, Turn(old, new, busy=False, room=old + new < slots, old_ready=old > 0))
        steps.append(action)
        if action is Step.DONE:
            return steps
        old, new = (old, new + 1) if action is Step.START else (old - 1, new) if action is Step.DRAIN else (old, new)
    raise AssertionError(steps)


def test_with_a_free_index_each_new_instance_starts_before_an_old_one_drains() -> None:
    S, D = Step.START, Step.DRAIN
    assert _play(2, 3) == [S, D, S, D, Step.DONE]


def test_without_one_each_old_instance_drains_first_and_its_index_takes_the_new_one() -> None:
    S, D = Step.START, Step.DRAIN
    assert _play(2, 2) == [D, S, D, S, Step.DONE]


def test_it_waits_while_an_instance_starts_or_drains_and_for_old_ones_not_yet_registered() -> None:
    roll = Roll({0, 1}, 2)
    assert step(roll, Turn(2, 0, busy=True, room=True, old_ready=True)) is Step.WAIT
    assert step(roll, Turn(2, 1, busy=False, room=False, old_ready=False)) is Step.WAIT


def test_an_old_instance_that_left_and_has_not_exited_holds_the_next_drain_back() -> None:
    """Old instance 1 was drained: it left the broker (its requests handed over) and its process exits. Draining
    old instance 0 now would leave the model with no instance serving and none started: the roll waits, and starts
    the new one in the index 1 frees once it has exited."""
    roll = Roll({0, 1}, 2)
    leaving = turn({0, 1}, {0: False}, starting=0, room=lambda: False)
    assert leaving.busy and step(roll, leaving) is Step.WAIT
    exited = turn({0}, {0: False}, starting=0, room=lambda: True)
    assert step(Roll({0}, 2), exited) is Step.START
    assert turn({0}, {0: False, 1: False}, starting=0, room=lambda: False).new == 1  # the new one, ready


def test_a_turn_counts_old_new_starting_and_draining_instances() -> None:
    seen = turn({0, 1}, {0: False, 1: True, 2: False}, starting=1, room=lambda: True)
    assert (seen.old, seen.new, seen.busy, seen.room, seen.old_ready) == (2, 2, True, False, True)
    idle = turn({0}, {0: False, 2: False}, starting=0, room=lambda: True)
    assert (idle.old, idle.new, idle.busy, idle.room, idle.old_ready) == (1, 1, False, True, True)


def test_a_model_with_no_instance_is_done_at_once_and_one_that_cannot_start_more_too() -> None:
    assert step(Roll(set(), 0), Turn(0, 0, busy=False, room=True, old_ready=False)) is Step.DONE
    assert step(Roll({0}, 2), Turn(0, 1, busy=False, room=False, old_ready=False)) is Step.DONE


def test_rows_are_taken_first_fit_around_those_taken() -> None:
    assert allocate({0, 1, 5}, 12, 2, 3, 7) == [(7, 2), (8, 6)]
    assert allocate({0, 1, 5}, 8, 2, 3, 7) is None  # 2..4 fits, then 6..8 would pass the table's end
    assert allocate(set(), 4, 0, 4, 0) == []
