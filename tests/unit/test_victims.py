"""The choice of the requests to preempt (mpserve.server.preemption), on plain records, no sockets."""

from __future__ import annotations

from mpserve.server.preemption import MAX_PREEMPTIONS, Running, victims

W, X = b"w0", b"w1"
ROOM = {W: 2, X: 2}


def run(ticket: str, priority: int = 0, started: float = 0.0, preemptions: int = 0, worker: bytes = W) -> Running:
    return Running(ticket, priority, started, preemptions, worker)


def test_the_lowest_priority_gives_way() -> None:
    running = [run("a", priority=5), run("b", priority=-3), run("c", priority=0)]
    assert victims([10], running, ROOM) == ["b"]


def test_of_equal_priorities_the_one_started_last() -> None:
    running = [run("early", started=1.0), run("late", started=9.0), run("middle", started=5.0)]
    assert victims([1], running, ROOM) == ["late"]


def test_only_a_lower_priority_is_preempted() -> None:
    assert victims([0], [run("a", priority=0)], ROOM) == []
    assert victims([-1], [run("a", priority=0)], ROOM) == []


def test_one_victim_for_each_waiting_request_that_can_have_one() -> None:
    running = [run("a", priority=0, started=1), run("b", priority=0, started=2), run("c", priority=3)]
    assert victims([5, 5], running, ROOM) == ["b", "a"]
    assert victims([5, 2, 9], running, ROOM) == ["b", "a"]  # the second finds "c" too high: the search ends
    assert victims([5, 5, 5, 5], running, {W: 9}) == ["b", "a", "c"]


def test_a_request_preempted_often_enough_runs_to_its_end() -> None:
    running = [run("tired", priority=-5, preemptions=MAX_PREEMPTIONS), run("fresh", priority=0)]
    assert victims([1], running, ROOM) == ["fresh"]
    assert victims([1], running[:1], ROOM) == []


def test_a_worker_without_room_to_park_gives_no_victim() -> None:
    running = [run("a", priority=-5, worker=W), run("b", priority=0, worker=X)]
    assert victims([1], running, {W: 0, X: 1}) == ["b"]
    assert victims([1, 1], running, {W: 1, X: 0}) == ["a"]
    assert victims([1], running, {}) == []
