"""What each slot's cells hold and how a prompt gets the most of them (``mpserve.engine.cells``), on a fake KV
memory: reuse in the slot, copies from another, catching up, twins, and the memory that cannot be cut."""

from __future__ import annotations

import pytest
from engine_fakes import FakeMemory, sequence

from mpserve.engine.cells import Cells
from mpserve.engine.sequence import PROMPT_CHUNK, Sequence
from mpserve.errors import Busy

pytestmark = pytest.mark.timeout(10)

A = list(range(1, 2 * PROMPT_CHUNK + 100))  # a long prompt
B = [7] * 300


def cells(memory: FakeMemory, running: dict[int, Sequence] | None = None, *, exact: bool = False,
          kv_unified: bool = False, n_swa: int = 1) -> Cells:
    return Cells(memory, len(memory.cells), {} if running is None else running, exact=exact, kv_unified=kv_unified,
                 n_swa=n_swa, has_store=False)


def held(c: Cells, memory: FakeMemory, slot: int, tokens: list[int]) -> None:
    """``slot`` holds cells of ``tokens`` (as a finished request leaves them)."""
    memory.fill(slot, len(tokens))
    c.start(slot, tokens, len(tokens), "")


def test_the_best_slot_shares_the_longest_prefix_and_ties_go_to_the_least_recently_used() -> None:
    memory = FakeMemory(3)
    c = cells(memory)
    held(c, memory, 0, B)
    held(c, memory, 1, A[:600])
    held(c, memory, 2, A[:100])
    assert c.best_slot([0, 1, 2], A + [5]) == (1, 600)
    assert c.best_slot([0, 2], A + [5]) == (2, 100)
    assert c.best_slot([0, 1, 2], [99, 98]) == (0, 0)  # nothing shared: slot 0 was used longest ago
    assert c.best_slot([0, 1, 2], A[:600]) == (1, 599)  # the last prompt token is always computed again
    with pytest.raises(Busy):
        c.best_slot([], A)


def test_exact_reuses_whole_chunks_only_and_never_cells_computed_at_any_length() -> None:
    memory = FakeMemory(2)
    c = cells(memory, exact=True)
    memory.fill(0, 700)
    c.start(0, A[:700], 700, "")  # reused at 700: whole cells are the 700 counted as whole by start
    assert c.whole[0] == 700 and c.reusable(0, A) == PROMPT_CHUNK
    memory.fill(1, 700)
    c.set(1, A[:700], 0)  # cells of a reply or a scored prompt: no whole chunks
    assert c.reusable(1, A) == 0
    assert c.usable(700) == PROMPT_CHUNK and cells(memory).usable(700) == 700


def test_taking_a_slots_cells_cuts_them_after_the_shared_prefix() -> None:
    memory = FakeMemory(1)
    c = cells(memory)
    held(c, memory, 0, A[:600])
    assert c.take_cells(0, A[:300] + [0, 0]) == 300
    assert memory.cells[0] == list(range(300))


def test_a_memory_that_cannot_be_cut_there_empties_the_slot_and_reuses_nothing() -> None:
    memory = FakeMemory(1, cut=False)
    c = cells(memory)
    held(c, memory, 0, A[:600])
    assert c.take_cells(0, A[:300] + [0, 0]) == 0
    assert memory.cells[0] == []


def test_cells_a_sliding_window_dropped_are_never_reused() -> None:
    memory = FakeMemory(1)
    c = cells(memory, n_swa=64)
    held(c, memory, 0, A[:600])
    memory.fill(0, 600, first=500)  # a restored windowed state: only its last cells
    assert not c.holds_cells(0, 300)  # a token at 300 needs cells from 236 on
    assert c.holds_cells(0, 0)
    assert c.take_cells(0, A[:300] + [0]) == 0 and memory.cells[0] == []


@pytest.mark.parametrize("kv_unified", [False, True])
def test_a_prompt_being_computed_catches_up_with_a_longer_prefix_in_another_slot(kv_unified: bool) -> None:
    memory = FakeMemory(2)
    seq = sequence(1, A, 100)
    c = cells(memory, {1: seq}, kv_unified=kv_unified)
    held(c, memory, 0, A[:700])
    memory.fill(1, 100)
    c.catch_up([seq])
    assert (seq.n_past, seq.reused, c.reused, c.copies) == (700, 700, 700 + 600, 1)
    assert memory.cells[1] == list(range(700))
    # one pool: the cells get a second owner; a stream each: the stream is copied, then cut after the prefix
    assert memory.calls[-1] == (("cp", 0, 1, 0, 700) if kv_unified else ("rm", 1, 700, -1))
    c.catch_up([seq])  # nothing more to take
    assert c.copies == 1


def test_a_scored_prompt_never_starts_from_other_cells() -> None:
    memory = FakeMemory(2)
    seq = sequence(1, A, 0)
    seq.score_prompt = True
    c = cells(memory, {1: seq})
    held(c, memory, 0, A[:700])
    c.catch_up([seq])
    assert seq.n_past == 0 and c.copies == 0


def test_twins_take_all_of_the_lead_prompts_cells_and_its_last_row() -> None:
    memory = FakeMemory(3)
    lead, twin = sequence(0, B, len(B)), sequence(2, B, 0)
    lead.output_row = 41
    c = cells(memory, {0: lead, 2: twin}, n_swa=64)
    memory.fill(0, len(B))
    assert c.share(lead, [twin]) == [twin]
    assert (twin.n_past, twin.reused, twin.output_row, c.reused) == (len(B), len(B), 41, len(B))
    assert memory.cells[2] == list(range(len(B)))
    memory.fill(0, len(B), first=250)  # its window passed cells a token at 300 needs: the twins compute their own
    assert c.share(lead, [sequence(1, B, 0)]) == []


def test_a_finished_sequence_leaves_its_cells_for_the_next_prompt() -> None:
    memory = FakeMemory(1)
    seq = sequence(0, A[:600], 600, decoding=True)
    seq.generated = [5, 6, 7]
    seq.n_past = 602  # the last token sampled has no cell
    running = {0: seq}
    c = cells(memory, running, exact=True)
    assert c.kv_cells(0) == 602 and c.kv_tokens(0) == A[:600] + [5, 6]
    del running[0]
    c.finished(seq)
    assert c.cached[0] == A[:600] + [5, 6] and c.whole[0] == PROMPT_CHUNK and c.kv_cells(0) == 602
    memory.fill(0, 602)
    assert c.erase(0) == 602 and c.cached[0] == [] and memory.cells[0] == []
