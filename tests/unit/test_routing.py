"""Routing and the retry rules (mpserve.server.routing), on the broker's own records, no sockets."""

from __future__ import annotations

import pytest

from mpserve import protocol as wire
from mpserve.server.routing import MAX_CRASHES, MIN_SHARED_PREFIX, AfterLoss, after_loss, choose_slot, choose_slots
from mpserve.server.state import Pending, RequestState, WorkerEntry

pytestmark = pytest.mark.timeout(10)

PREAMBLE = "You are a careful assistant. Answer in one short sentence. "
assert len(PREAMBLE) >= MIN_SHARED_PREFIX


def worker(name: str, capacity: int = 1, device: int = -1, running: int = 0,
           prompts: dict[int, str] | None = None) -> WorkerEntry:
    entry = WorkerEntry(name.encode(), None, "m", device, capacity, pid=1, prompts=prompts or {})
    entry.running = {f"t{i}": i for i in range(running)}
    return entry


def table(*entries: WorkerEntry) -> dict[bytes, WorkerEntry]:
    return {e.identity: e for e in entries}


def test_a_slot_holding_the_prompt_prefix_wins_over_one_free_longer() -> None:
    workers = table(worker("a", prompts={0: "something else entirely, nothing shared here"}),
                    worker("b", prompts={0: PREAMBLE + "What is 2+2?"}))
    assert choose_slot([(b"a", 0), (b"b", 0)], workers, PREAMBLE + "What is 3+3?") == (b"b", 0)


def test_the_longest_shared_prefix_wins() -> None:
    workers = table(worker("a", prompts={0: PREAMBLE}), worker("b", prompts={0: PREAMBLE + "Tell me about X"}))
    assert choose_slot([(b"a", 0), (b"b", 0)], workers, PREAMBLE + "Tell me about Y") == (b"b", 0)


def test_a_prefix_shorter_than_the_minimum_does_not_count() -> None:
    short = PREAMBLE[:MIN_SHARED_PREFIX - 1]
    workers = table(worker("a"), worker("b", prompts={0: short + "xyz"}))
    assert choose_slot([(b"a", 0), (b"b", 0)], workers, short + "abc" * 20) == (b"a", 0)  # free the longest


def test_a_batching_instance_holding_the_prefix_in_another_slot_is_preferred_and_its_holder_first() -> None:
    busy = worker("b", capacity=4, running=1, prompts={0: PREAMBLE + "q0", 1: "unrelated prompt, long enough...."})
    workers = table(worker("a", capacity=4), busy)
    free = [(b"a", 0), (b"b", 1), (b"b", 2)]
    assert choose_slot(free, workers, PREAMBLE + "q1") == (b"b", 1)  # b holds it (slot 0 runs); 1 is free first
    busy.prompts[2] = PREAMBLE + "q9"
    assert choose_slot(free, workers, PREAMBLE + "q1") == (b"b", 2)  # the slot that holds it itself


def test_without_a_prefix_the_least_busy_instance_gets_the_request() -> None:
    workers = table(worker("a", capacity=4, running=2), worker("b", capacity=4, running=1))
    assert choose_slot([(b"a", 3), (b"b", 2)], workers, "hi") == (b"b", 2)


def test_requests_spread_over_instances_before_sharing_one_batch() -> None:
    workers = table(worker("a", capacity=2), worker("b", capacity=2))
    free = [(b"a", 0), (b"a", 1), (b"b", 0), (b"b", 1)]
    taken = []
    for _ in range(4):
        slot = choose_slot(free, workers, "no shared prefix")
        assert slot is not None
        free.remove(slot)
        workers[slot[0]].running[f"t{len(taken)}"] = slot[1]
        taken.append(slot[0])
    assert taken == [b"a", b"b", b"a", b"b"]


def test_a_device_filter_keeps_to_that_device_and_none_found_is_none() -> None:
    workers = table(worker("a", device=0), worker("b", device=1))
    assert choose_slot([(b"a", 0), (b"b", 0)], workers, "hi", device=1) == (b"b", 0)
    assert choose_slot([(b"a", 0)], workers, "hi", device=1) is None
    assert choose_slot([], workers, "hi") is None


def pending(state: RequestState, crashes: int, generated: list[int], known: bool = True) -> Pending:
    p = Pending("t1", b"c", wire.Request("r1", "hi"), "m", 0.0, None, state=state)
    p.crashes = crashes
    p.generated += wire.token_frame(generated)
    p.tokens_known = known
    return p


def test_n_choices_take_n_free_slots_of_one_instance_or_wait() -> None:
    workers = table(worker("a", capacity=4, running=2), worker("b", capacity=4, prompts={1: PREAMBLE}))
    free = [(b"a", 2), (b"a", 3), (b"b", 0), (b"b", 1), (b"b", 2)]
    assert choose_slots(free, workers, "hi", 2) == [(b"b", 0), (b"b", 1)]  # the least busy instance
    assert choose_slots(free, workers, PREAMBLE + "more", 3) == [(b"b", 1), (b"b", 0), (b"b", 2)]  # the holder first
    assert choose_slots(free[:4], workers, "hi", 2) == [(b"b", 0), (b"b", 1)]
    assert choose_slots(free, workers, "hi", 4) is None  # no instance has 4 free: the request waits
    assert choose_slots(free, workers, "hi", 1) == [choose_slot(free, workers, "hi")]
    assert choose_slots(free, workers, "hi", 2, device=7) is None


@pytest.mark.parametrize("state, crashes, generated, known, outcome", [
    (RequestState.RUNNING, 1, [], True, AfterLoss.RETRY),  # nothing streamed: retried transparently
    (RequestState.STREAMING, 1, [5, 6], True, AfterLoss.RETRY),  # streamed, its tokens known: resumed from them
    (RequestState.STREAMING, 1, [], False, AfterLoss.LOST),  # streamed by a worker that did not report tokens
    (RequestState.STREAMING, 1, [5, 6], False, AfterLoss.LOST),  # ... after one that did: some are missing
    (RequestState.RUNNING, MAX_CRASHES, [], True, AfterLoss.POISON),  # it has now crashed two workers
    (RequestState.STREAMING, MAX_CRASHES, [5], True, AfterLoss.POISON),
])
def test_what_becomes_of_a_request_whose_worker_died(state: RequestState, crashes: int, generated: list[int],
                                                     known: bool, outcome: AfterLoss) -> None:
    assert after_loss(pending(state, crashes, generated, known)) is outcome
