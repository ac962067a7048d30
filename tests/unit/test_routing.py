"""Routing and the retry rules (mpserve.server.routing), on the broker's own records, no sockets."""

from __future__ import annotations

import random
import signal

import pytest

from mpserve.errors import CODES, ErrorCode
from mpserve.server.ram_prefixes import RamPrefixes
from mpserve.server.routing import (
    CRASH_SIGNALS,
    MAX_CRASHES,
    MAX_HANDOVERS,
    MAX_PASSED,
    MIN_SHARED_PREFIX,
    MODEL_CRASHES,
    AfterLoss,
    Route,
    Source,
    after_loss,
    choose_slot,
    choose_slots,
    crash_signal,
    crash_streak,
    describe_exit,
    pick_queued,
    stranded,
)
from mpserve.server.state import ModelQueue, Pending, RequestState, WorkerEntry
from mpserve.wire import protocol as wire
from mpserve.wire.prefix import PREFIX_BLOCK, block_hashes, common_prefix

pytestmark = pytest.mark.timeout(10)

PREAMBLE = "You are a careful assistant. Answer in one short sentence. "
assert len(PREAMBLE) >= MIN_SHARED_PREFIX


def worker(name: str, capacity: int = 1, device: int = -1, running: int = 0,
           prompts: dict[int, str] | None = None) -> WorkerEntry:
    entry = WorkerEntry(name.encode(), None, "m", device, capacity, pid=1,
                        prompts={slot: (b"", text) for slot, text in (prompts or {}).items()})
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


def test_a_prefix_of_exactly_the_minimum_counts() -> None:
    exact = PREAMBLE[:MIN_SHARED_PREFIX]
    workers = table(worker("a"), worker("b", prompts={0: exact + "xyz"}))
    free = [(b"a", 0), (b"b", 0)]
    assert choose_slot(free, workers, exact) == (b"b", 0)  # the whole prompt is the minimum
    assert choose_slot(free, workers, exact + "abc") == (b"b", 0)  # the prompts share the minimum


def test_a_two_slot_instance_holding_the_prefix_in_its_other_slot_is_a_kv_route() -> None:
    pair = worker("b", capacity=2, running=1, prompts={0: PREAMBLE + "q0"})
    workers = table(worker("a", capacity=2), pair)
    assert choose_slots([(b"a", 0), (b"b", 1)], workers, PREAMBLE + "q1", 1) == Route([(b"b", 1)], Source.KV)


def test_a_batching_instance_holding_the_prefix_in_another_slot_is_preferred_and_its_holder_first() -> None:
    busy = worker("b", capacity=4, running=1, prompts={0: PREAMBLE + "q0", 1: "unrelated prompt, long enough...."})
    workers = table(worker("a", capacity=4), busy)
    free = [(b"a", 0), (b"b", 1), (b"b", 2)]
    assert choose_slot(free, workers, PREAMBLE + "q1") == (b"b", 1)  # b holds it (slot 0 runs); 1 is free first
    busy.prompts[2] = (b"", PREAMBLE + "q9")
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


FR, DE = (("fr", 1.0),), (("de", 1.0),)


def test_requests_of_one_adapter_set_go_where_that_set_runs_before_an_idle_or_a_mixed_instance() -> None:
    workers = table(worker("idle", capacity=4), worker("fr", capacity=4, running=3),
                    worker("de", capacity=4, running=1))
    free = [(b"idle", 0), (b"de", 1), (b"fr", 3)]
    sets = {b"idle": set(), b"fr": {FR}, b"de": {DE}}
    assert choose_slot(free, workers, "hi", adapters=FR, sets=sets) == (b"fr", 3)  # batches with its set, however busy
    assert choose_slot(free, workers, "hi", adapters=(("it", 1.0),), sets=sets) == (b"idle", 0)  # switches at once
    assert choose_slot(free[1:], workers, "hi", adapters=(("it", 1.0),), sets=sets) == (b"de", 1)  # then least busy
    assert choose_slot(free, workers, "hi", adapters=FR, sets=None) == (b"idle", 0)  # a model without adapters


def test_the_base_model_is_one_more_set_of_a_model_with_adapters_and_plain_traffic_spreads() -> None:
    workers = table(worker("a", capacity=2, running=1), worker("b", capacity=2), worker("c", capacity=2, running=1))
    sets = {b"a": {()}, b"b": set(), b"c": {FR}}
    free = [(b"c", 1), (b"b", 0), (b"a", 1)]
    assert choose_slot(free, workers, "hi", sets=sets) == (b"a", 1)  # batches with the base model's requests
    assert choose_slot(free[:2], workers, "hi", sets=sets) == (b"b", 0)  # then idle, not the one running an adapter
    assert choose_slot(free, workers, "hi") == (b"b", 0)  # a model without adapters: the least busy


def test_a_younger_request_goes_first_where_it_batches_and_the_oldest_is_passed_over_a_bounded_number_of_times(
        ) -> None:
    window = [(DE, 0), ((), 0), (FR, 0)]
    assert pick_queued(window, alone={FR}) == 2  # an instance runs fr alone and has a free slot
    assert pick_queued(window, alone={DE, FR}) == 0  # the oldest batches too: it goes
    assert pick_queued(window, alone=set()) == 0  # nothing batches: the oldest
    assert pick_queued([(DE, MAX_PASSED), *window[1:]], alone={FR}) == 0  # passed over enough


def test_a_device_filter_keeps_to_that_device_and_none_found_is_none() -> None:
    workers = table(worker("a", device=0), worker("b", device=1))
    assert choose_slot([(b"a", 0), (b"b", 0)], workers, "hi", device=1) == (b"b", 0)
    assert choose_slot([(b"a", 0)], workers, "hi", device=1) is None
    assert choose_slot([], workers, "hi") is None


# --- prefixes held in an instance's host-RAM prompt cache ---------------------------------------------------

DOCUMENT = "".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog. " for i in range(100))  # 6,000 chars


def in_ram(entry: WorkerEntry, *texts: str, first_id: int = 1) -> WorkerEntry:
    """``entry`` with its prompt cache holding ``texts`` (as its CACHE frames would say)."""
    entry.ram.apply(wire.CacheChanges(tuple((first_id + i, wire.pack_hashes(block_hashes(t)))
                                            for i, t in enumerate(texts))))
    return entry


def test_a_prompt_pushed_out_of_every_slot_goes_to_the_instance_holding_it_in_ram() -> None:
    prompt = DOCUMENT + " Summarize it."
    workers = table(worker("a", prompts={0: "something else"}),
                    in_ram(worker("b", prompts={0: "another one"}), DOCUMENT[:3 * PREFIX_BLOCK]))
    free = [(b"a", 0), (b"b", 0)]  # a free the longest: without the cache it would go there
    assert choose_slot(free, workers, prompt) == (b"a", 0)  # the prompt's block hashes not given: not looked at
    assert choose_slots(free, workers, prompt, 1, blocks=block_hashes(prompt)) == Route([(b"b", 0)], Source.RAM)
    assert choose_slot(free, workers, prompt, blocks=block_hashes(prompt)) == (b"b", 0)


def test_n_choices_go_to_the_instance_whose_host_store_holds_the_prompt() -> None:
    prompt = DOCUMENT + " Summarize it."
    workers = table(worker("a", capacity=2), in_ram(worker("b", capacity=2), DOCUMENT[:3 * PREFIX_BLOCK]))
    free = [(b"a", 0), (b"a", 1), (b"b", 0), (b"b", 1)]
    assert choose_slots(free, workers, prompt, 2, blocks=block_hashes(prompt)) == Route([(b"b", 0), (b"b", 1)],
                                                                                        Source.RAM)


def test_the_longest_prefix_in_ram_wins_and_an_unrelated_one_does_not_count() -> None:
    prompt = DOCUMENT + " Summarize it."
    workers = table(in_ram(worker("a"), DOCUMENT[:2 * PREFIX_BLOCK]), in_ram(worker("b"), DOCUMENT[:5 * PREFIX_BLOCK]),
                    in_ram(worker("c"), "x" + DOCUMENT))  # c shares no prefix: its hashes are all other
    free = [(b"c", 0), (b"a", 0), (b"b", 0)]
    assert choose_slots(free, workers, prompt, 1, blocks=block_hashes(prompt)) == Route([(b"b", 0)], Source.RAM)
    assert workers[b"c"].ram.longest(block_hashes(prompt)) == 0
    assert workers[b"b"].ram.longest(block_hashes(prompt)) == 5 * PREFIX_BLOCK


def test_a_prefix_in_kv_cells_wins_over_one_as_long_in_ram_and_a_longer_one_in_ram_wins_over_kv() -> None:
    prompt = DOCUMENT + " Summarize it."
    blocks = block_hashes(prompt)
    workers = table(in_ram(worker("a"), DOCUMENT[:4 * PREFIX_BLOCK]),
                    worker("b", prompts={0: DOCUMENT[:4 * PREFIX_BLOCK] + "Tell me more."}))
    free = [(b"a", 0), (b"b", 0)]
    assert choose_slots(free, workers, prompt, 1, blocks=blocks) == Route([(b"b", 0)], Source.KV)  # same length
    in_ram(workers[b"a"], DOCUMENT[:6 * PREFIX_BLOCK], first_id=9)
    assert choose_slots(free, workers, prompt, 1, blocks=blocks) == Route([(b"a", 0)], Source.RAM)  # longer


def test_what_an_instance_holds_in_ram_follows_additions_and_evictions_and_goes_when_cleared() -> None:
    entry = in_ram(worker("a"), DOCUMENT[:3 * PREFIX_BLOCK], DOCUMENT[:2 * PREFIX_BLOCK] + "x" * PREFIX_BLOCK)
    blocks = block_hashes(DOCUMENT)
    assert entry.ram.longest(blocks) == 3 * PREFIX_BLOCK
    entry.ram.apply(wire.CacheChanges(dropped=(1,)))  # the longer one evicted: the other still holds two blocks
    assert entry.ram.longest(blocks) == 2 * PREFIX_BLOCK
    entry.ram.apply(wire.CacheChanges(dropped=(2, 77)))  # an id never heard of is ignored
    assert entry.ram.longest(blocks) == 0 and not entry.ram
    in_ram(entry, DOCUMENT, first_id=3)
    entry.ram.clear()  # the model unloaded: its cache went with it
    assert not entry.ram and entry.ram.longest(blocks) == 0


def test_what_a_worker_says_it_holds_in_ram_is_bounded_the_oldest_entries_forgotten_first() -> None:
    ram = RamPrefixes(limit=20)
    texts = [f"{i} " + DOCUMENT for i in range(4)]  # 11 blocks each (at most 256 per entry on the wire)
    for i, text in enumerate(texts):
        ram.apply(wire.CacheChanges(((i, wire.pack_hashes(block_hashes(text))),)))
    assert [ram.longest(block_hashes(t)) > 0 for t in texts] == [False, False, False, True]
    ram.apply(wire.CacheChanges(((9, wire.pack_hashes(block_hashes(DOCUMENT * 4))),)))  # alone over the limit
    assert not ram


def pending(state: RequestState, crashes: int, generated: list[int], known: bool = True, handovers: int = 0
            ) -> Pending:
    p = Pending("t1", b"c", wire.Request("r1", "hi"), "m", 0.0, None, state=state)
    p.crashes, p.handovers = crashes, handovers
    p.generated += wire.token_frame(generated)
    p.tokens_known = known
    return p


def test_n_choices_take_n_free_slots_of_one_instance_or_wait() -> None:
    workers = table(worker("a", capacity=4, running=2), worker("b", capacity=4, prompts={1: PREAMBLE}))
    free = [(b"a", 2), (b"a", 3), (b"b", 0), (b"b", 1), (b"b", 2)]
    assert choose_slots(free, workers, "hi", 2) == Route([(b"b", 0), (b"b", 1)], Source.LOAD)  # the least busy
    assert choose_slots(free, workers, PREAMBLE + "more", 3) == Route([(b"b", 1), (b"b", 0), (b"b", 2)],
                                                                      Source.KV)  # the holder first
    assert choose_slots(free[:4], workers, "hi", 2) == Route([(b"b", 0), (b"b", 1)], Source.LOAD)
    assert choose_slots(free, workers, "hi", 4) is None  # no instance has 4 free: the request waits
    assert choose_slots(free, workers, "hi", 1) == Route([choose_slot(free, workers, "hi")], Source.LOAD)
    assert choose_slots(free, workers, "hi", 2, device=7) is None
    assert choose_slots(free, workers, "hi", 1, device=7) is None


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


@pytest.mark.parametrize("state, crashes, handovers, generated, outcome", [
    (RequestState.STREAMING, 0, 1, [5], AfterLoss.RETRY),  # killed from outside: resumed, no crash counted
    (RequestState.RUNNING, 0, MAX_HANDOVERS - 1, [], AfterLoss.RETRY),  # any number below the bound
    (RequestState.STREAMING, 1, MAX_HANDOVERS - 1, [5], AfterLoss.RETRY),  # hand-overs never make it poison
    (RequestState.RUNNING, 0, MAX_HANDOVERS, [], AfterLoss.BOUND),  # the bound: not handed over again
    (RequestState.STREAMING, 1, MAX_HANDOVERS, [5], AfterLoss.BOUND),
    (RequestState.RUNNING, MAX_CRASHES, MAX_HANDOVERS, [], AfterLoss.POISON),  # a crash it caused names it
])
def test_hand_overs_are_bounded_apart_from_crashes(state: RequestState, crashes: int, handovers: int,
                                                   generated: list[int], outcome: AfterLoss) -> None:
    assert after_loss(pending(state, crashes, generated, handovers=handovers)) is outcome


@pytest.mark.parametrize("code, crash", [
    (-signal.SIGSEGV, signal.SIGSEGV), (-signal.SIGBUS, signal.SIGBUS), (-signal.SIGFPE, signal.SIGFPE),
    (-signal.SIGILL, signal.SIGILL), (-signal.SIGABRT, signal.SIGABRT),  # what a request can make an engine do
    (-signal.SIGKILL, None), (-signal.SIGTERM, None), (-signal.SIGINT, None),  # sent from outside
    (0, None), (1, None), (3, None), (None, None), (-200, None),  # an exit code, an unknown status, no signal
])
def test_only_a_crash_signal_is_a_crash(code: int | None, crash: signal.Signals | None) -> None:
    assert crash_signal(code) is crash


def test_an_exit_status_in_words() -> None:
    assert [describe_exit(c) for c in (-signal.SIGSEGV, -signal.SIGKILL, 1, 0, None, -200)] == [
        "signal SIGSEGV", "signal SIGKILL", "code 1", "code 0", "unknown status", "signal 200"]


def test_a_models_crash_streak_grows_once_per_crash_with_a_request_new_to_it() -> None:
    mq = ModelQueue("m", 8)
    for tickets, streak in [(["a"], 1), (["a"], 1), ([], 1), (["a", "b", "c", "d"], 2), (["b", "e"], 3)]:
        mq.crash_streak = crash_streak(mq, tickets)
        mq.crashed.update(tickets)
        assert mq.crash_streak == streak, tickets
    assert MODEL_CRASHES > MAX_CRASHES  # one request, poison after MAX_CRASHES crashes, cannot fail its model


def test_the_error_table_states_these_rules() -> None:
    poison = CODES[ErrorCode.POISON_REQUEST].meaning
    assert MAX_CRASHES == 2 and "two instances that crashed" in poison and all(s.name in poison for s in CRASH_SIGNALS)
    assert f"lost {MAX_HANDOVERS} instances" in CODES[ErrorCode.WORKER_LOST].meaning
    assert f"crashed on {MODEL_CRASHES} different requests" in CODES[ErrorCode.MODEL_FAILED].meaning


def _ranked(free: list[tuple[bytes, int]], workers: dict[bytes, WorkerEntry], prompt: str) -> tuple[bytes, int]:
    """choose_slot's rule, spelled out over every free slot (no shortcut): the longest prefix to route by
    (its own slot's first), else the least busy instance; among equals the first in ``free``."""
    def key(f: tuple[bytes, int]) -> tuple[int, int, float]:
        entry = workers[f[0]]
        own = common_prefix(entry.prompts.get(f[1], (b"", ""))[1], prompt) if len(prompt) >= MIN_SHARED_PREFIX else 0
        anywhere = max([own] + [common_prefix(p, prompt) for _, p in entry.prompts.values()]
                       if len(prompt) >= MIN_SHARED_PREFIX and entry.capacity > 1 else [own])
        at_least = [s if s >= MIN_SHARED_PREFIX else 0 for s in (anywhere, own)]
        return at_least[0], at_least[1], -len(entry.running) / entry.capacity

    best = max(key(f) for f in free)
    return next(f for f in free if key(f) == best)


@pytest.mark.parametrize("seed", range(40))
def test_the_slot_chosen_is_the_one_the_rule_ranks_first_among_all_free_slots(seed: int) -> None:
    rng = random.Random(seed)
    texts = [PREAMBLE + "question one", PREAMBLE + "question two", "unrelated " * 5, "ping"]
    workers = table(*(worker(f"w{i}", capacity=rng.choice([1, 4, 32]), running=0) for i in range(3)))
    free = []
    for entry in workers.values():
        for slot in range(entry.capacity):
            if rng.random() < 0.3:
                entry.prompts[slot] = (b"", rng.choice(texts))
            if rng.random() < 0.7:
                free.append((entry.identity, slot))
            else:
                entry.running[f"t{slot}"] = slot
    rng.shuffle(free)
    if not free:
        return
    prompt = rng.choice(texts) + rng.choice(["", " more"])
    assert choose_slot(free, workers, prompt) == _ranked(free, workers, prompt)
    route = choose_slots(free, workers, prompt, 1)
    assert route is not None and route.slots == [_ranked(free, workers, prompt)]


def test_a_prefix_in_the_host_store_goes_to_the_least_busy_instance_of_that_host_and_kv_cells_still_win() -> None:
    prompt = DOCUMENT + " Summarize it."
    mq = ModelQueue("m", 8)
    here, there = mq.store(""), mq.store("pool-b")
    a, b, c = (worker(n, capacity=2, running=r) for n, r in (("a", 1), ("b", 0), ("c", 0)))
    a.ram = b.ram = here  # a and b on this host share its store's view; c is a remote pool's
    c.ram, c.host = there, "pool-b"
    in_ram(a, DOCUMENT[:3 * PREFIX_BLOCK])  # a saved it: b can restore it as well, and is less busy
    workers = table(a, b, c)
    free = [(b"a", 1), (b"c", 0), (b"b", 0)]
    assert choose_slots(free, workers, prompt, 1, blocks=block_hashes(prompt)) == Route([(b"b", 0)], Source.RAM)
    b.prompts[0] = (b"", DOCUMENT[:4 * PREFIX_BLOCK])  # its KV cells hold the prefix, longer than the store
    b.running["t"] = 1
    a.prompts[1] = (b"", "something else")
    assert choose_slots(free, workers, prompt, 1, blocks=block_hashes(prompt)) == Route([(b"b", 0)], Source.KV)
    assert there.longest(block_hashes(prompt)) == 0  # the other host's store holds none of it


@pytest.mark.parametrize(("names", "held", "starting", "never"), [
    ({"a1"}, [{"a0"}, {"a0", "a1"}], False, False),  # one instance has it
    ({"a0", "a1"}, [{"a0"}, {"a1"}], False, True),  # each has one, none both: it runs nowhere
    ({"a1"}, [{"a0"}], True, False),  # an instance starting is sent every adapter served: it waits for it
    ({"a1"}, [{"a0"}], False, True),  # no instance has it, loads it or starts
    ({"a1"}, [], False, False),  # no instance at all: the model's own rule (no_instance_timeout)
])
def test_a_request_for_adapters_no_instance_has_or_will_have_is_stranded(
        names: set[str], held: list[set[str]], starting: bool, never: bool) -> None:
    assert stranded(names, held, starting) is never
