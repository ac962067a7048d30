"""Which rows go into the next decodes (``mpserve.engine.scheduler``) and how a prompt is cut into them
(``mpserve.engine.sequence``): slot order, the step's token budget, prompts computed once, lone long sequences."""

from __future__ import annotations

import pytest
from engine_fakes import sequence

from mpserve.engine.scheduler import LONE_KV_CELLS, Scheduler
from mpserve.engine.sequence import (
    PROMPT_CHUNK,
    SCORED_CHUNK,
    TAIL_MARKS,
    Phase,
    next_chunk,
    reaches_checkpoint,
    tail_marks,
)

pytestmark = pytest.mark.timeout(10)


def scheduler(budget: int = 64, *, exact: bool = False, kv_unified: bool = False, exact_rows: int = 7) -> Scheduler:
    return Scheduler(budget, exact=exact, kv_unified=kv_unified, exact_rows=exact_rows)


def test_decoding_rows_go_in_slot_order_and_prompts_in_admission_order() -> None:
    s = scheduler()
    for slot in (2, 0, 1):
        s.add(sequence(slot, [slot] * 10, 10))
    for slot in (2, 0):
        s.running[slot].phase = Phase.DECODE
    assert [seq.slot for seq in s.decoding()] == [0, 2]
    assert [seq.slot for seq in s.prefilling] == [2, 0, 1]
    s.remove(s.running[0])
    assert sorted(s.running) == [1, 2] and [seq.slot for seq in s.prefilling] == [2, 1]


def test_a_sequence_resumed_while_decoding_computes_no_prompt() -> None:
    s = scheduler()
    s.add(sequence(0, [1] * 10, 10, decoding=True))  # a parked sequence put back (``BatchEngine.resume``)
    s.add(sequence(1, [2] * 10, 4))  # one parked before its prompt was all computed
    assert [seq.slot for seq in s.decoding()] == [0]
    assert [seq.slot for seq in s.prefilling] == [1]


def test_a_step_computes_prompt_chunks_within_its_budget_and_never_cuts_one() -> None:
    s = scheduler(64)
    first, second, third = sequence(0, [1] * 1000), sequence(1, [2] * 40), sequence(2, [3] * 20)
    for seq in (first, second, third):
        s.add(seq)
    # while others decode: the first chunk whole (over the budget), then nothing more
    assert s.chunks(decoding=True) == [first]
    # idle: a whole chunk's worth of tokens, in admission order
    assert s.chunks(decoding=False) == [first]
    first.n_past = 1000 - 10
    assert s.chunks(decoding=True) == [first, second]  # 10 + 40 fit in 64; the 20 more do not
    assert s.chunks(decoding=False) == [first, second, third]


def test_a_prompt_another_chosen_prompt_is_computing_waits_to_copy_it() -> None:
    s = scheduler(4 * PROMPT_CHUNK)
    lead, twin, sharing, scored = (sequence(0, [1] * 300), sequence(1, [1] * 300), sequence(2, [1] * 200 + [2] * 50),
                                   sequence(3, [1] * 300))
    scored.score_prompt = True
    for seq in (lead, twin, sharing, scored):
        s.add(seq)
    assert s.chunks(decoding=False) == [lead, scored]  # a scored prompt computes its own rows
    s.prefilled([lead])  # its last chunk decoded
    assert s.twins(lead) == [twin] and lead not in s.prefilling
    exact = scheduler(4 * PROMPT_CHUNK, exact=True)
    for seq in (lead, sharing):
        exact.add(seq)
    assert exact.chunks(decoding=False) == [lead, sharing]  # exact copies whole chunks only: 200 is none


def test_exact_decodes_a_long_sequence_alone_with_a_stream_per_slot() -> None:
    short, long = sequence(0, [1] * 10, 10, decoding=True), sequence(1, [2] * 400, LONE_KV_CELLS, decoding=True)
    assert scheduler(exact=True).decodes([short, long]) == [[short], [long]]
    assert scheduler(exact=True, kv_unified=True).decodes([short, long]) == [[short, long]]
    assert scheduler().decodes([short, long]) == [[short, long]]
    assert scheduler(exact=True).decodes([]) == []
    long.n_past = LONE_KV_CELLS - 1
    assert scheduler(exact=True).decodes([short, long]) == [[short, long]]


def test_exact_decodes_at_most_the_rows_the_kernels_compute_as_a_lone_row() -> None:
    seqs = [sequence(slot, [slot] * 10, 10, decoding=True) for slot in range(5)]
    assert scheduler(exact=True, exact_rows=3).decodes(seqs) == [seqs[:3], seqs[3:]]  # repacked weights
    assert scheduler(exact=True, exact_rows=7).decodes(seqs) == [seqs]
    assert scheduler(exact_rows=3).decodes(seqs) == [seqs]  # reuse: any promises nothing of the kind


def test_exact_decodes_each_sequence_under_adapters_alone() -> None:
    one, two = sequence(0, [1] * 10, 10, decoding=True), sequence(1, [2] * 10, 10, decoding=True)
    one.adapters = two.adapters = (("a", 1.0),)
    assert scheduler(exact=True).decodes([one, two]) == [[one], [two]]
    assert scheduler(exact=True, kv_unified=True).decodes([one, two]) == [[one], [two]]
    assert scheduler().decodes([one, two]) == [[one, two]]


def test_a_prompt_is_cut_into_chunks_scored_chunks_and_at_its_marks() -> None:
    seq = sequence(0, [1] * 1300)
    assert next_chunk(seq) == PROMPT_CHUNK
    seq.n_past = 1024
    assert next_chunk(seq) == 1300 - 1024
    seq.marks = tail_marks(1300, 0)
    assert seq.marks == tuple(1300 - before for before in TAIL_MARKS)
    assert next_chunk(seq) == seq.marks[0] - 1024
    assert tail_marks(1300, 1300 - PROMPT_CHUNK) == ()  # less than a chunk computed: no split
    scored = sequence(0, [1] * 1300)
    scored.score_prompt = True
    assert next_chunk(scored) == SCORED_CHUNK


def test_checkpoints_fall_at_a_chunk_times_a_power_of_two() -> None:
    assert reaches_checkpoint(0, PROMPT_CHUNK) and reaches_checkpoint(PROMPT_CHUNK, 2 * PROMPT_CHUNK)
    assert not reaches_checkpoint(2 * PROMPT_CHUNK, 3 * PROMPT_CHUNK)
    assert reaches_checkpoint(3 * PROMPT_CHUNK, 4 * PROMPT_CHUNK) and not reaches_checkpoint(0, PROMPT_CHUNK - 1)


def test_a_prompt_admitted_ahead_of_the_running_ones_is_the_urgent_one() -> None:
    s = scheduler()
    s.add(sequence(0, [1] * 10, 10, decoding=True))
    s.add(sequence(1, [2] * 10))
    ahead = sequence(2, [3] * 10)
    ahead.alone = True
    s.add(ahead)
    assert s.urgent() is ahead


def test_a_newcomer_goes_ahead_of_the_decoding_rows_once() -> None:
    s = scheduler()
    started = sequence(0, [1] * 1000, 10)  # computing its prompt, a chunk done
    started.reused = 0
    s.add(started)
    newcomer, twin = sequence(1, [2] * 10), sequence(2, [2] * 10)  # twin: copies newcomer's cells when it is done
    s.add(newcomer)
    s.add(twin)
    assert s.urgent() is None  # nothing decodes: the prompts go together, in admission order
    s.add(sequence(3, [3] * 10, 10, decoding=True))
    assert s.urgent() is newcomer
    newcomer.n_past = 5  # its first chunk computed (a prompt cut at a mark): it goes with the others now
    assert s.urgent() is None
    long = sequence(4, [4] * 1000)  # its first token comes after its last chunk: it takes its chunks in turn
    s.add(long)
    assert s.urgent() is None
    cached = sequence(5, [5] * 1000, 990)  # admitted with its prompt's cells but the last 10 reused
    s.add(cached)
    assert s.urgent() is cached


def test_a_newcomer_of_another_adapter_set_waits_for_its_turn() -> None:
    """Going first would switch the context's adapters (a rebuild of llama.cpp's graphs) out of the sets' turns."""
    s = scheduler()
    s.add(sequence(0, [1] * 10, 10, decoding=True))
    other = sequence(1, [2] * 10)
    other.adapters = (("a0", 1.0),)
    s.add(other)
    assert s.urgent() is None and s.urgent(turn=(("a0", 1.0),)) is None  # none of a0 decodes
    s.running[0].adapters = (("a0", 1.0),)
    assert s.urgent(turn=(("a0", 1.0),)) is other and s.urgent() is None
