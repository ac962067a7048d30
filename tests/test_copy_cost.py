"""Whether a prompt copies another slot's cells or computes what they hold (``mpserve.engine.copy_cost``), on the
real engine and the tiny model, a stream of cells per slot, ``reuse: exact``: the engine measures both costs as it
loads and leaves nothing behind; under costs set by the test (so that the choice is certain) a prefix that does not
pay for a whole stream's copy is computed, one that does is copied, and the text is a fresh computation's either
way."""

from __future__ import annotations

import pytest
from engines import LONG_PROMPT, N_CTX, serve

from mpserve.engine.batch import BatchEngine
from mpserve.engine.copy_cost import CopyCost
from mpserve.engine.interface import Completion
from mpserve.engine.sequence import PROMPT_CHUNK
from mpserve.engine.settings import EngineSettings
from mpserve.wire.protocol import GenerateParams

pytestmark = pytest.mark.timeout(120)

FOLLOWER = LONG_PROMPT + " but then the owl flew off"  # it shares slot 0's prompt: a whole chunk and more


@pytest.fixture(scope="module")
def model_path() -> str:
    from mpserve.models.builtin import default_model_path

    return str(default_model_path())


def engine(model_path: str, parallel: int) -> BatchEngine:
    return BatchEngine(EngineSettings(model_path, n_ctx=N_CTX, parallel=parallel, threads=1, n_gpu_layers=0,
                                      reuse="exact"))  # compared with fresh computations


@pytest.fixture(scope="module")
def fresh(model_path: str) -> str:
    """FOLLOWER's text computed alone."""
    alone = engine(model_path, 1)
    try:
        return serve(alone, [(FOLLOWER, GenerateParams(max_tokens=12, temperature=0.0))])[0].text
    finally:
        alone.close()


def beside(model_path: str, cost: CopyCost) -> tuple[str, int, int]:
    """FOLLOWER admitted into empty slot 1 while slot 0 generates from LONG_PROMPT, under ``cost``, run to its
    end: its text, its reused tokens, the copies made meanwhile."""
    e = engine(model_path, 2)
    try:
        e._cells.copy_cost = cost
        e.admit(0, LONG_PROMPT, GenerateParams(max_tokens=60, temperature=0.0), lambda text, n: True)
        while e.kv_cells(0) <= PROMPT_CHUNK:
            e.step()
        e.admit(1, FOLLOWER, GenerateParams(max_tokens=12, temperature=0.0), lambda text, n: True)
        done: dict[int, Completion] = {}
        while 1 not in done:
            done.update(e.step())
        return done[1].text, done[1].reused_tokens, e.stats().prefix_copies
    finally:
        e.close()


def test_a_prefix_that_does_not_pay_for_a_streams_copy_is_computed(model_path: str, fresh: str) -> None:
    text, reused, copies = beside(model_path, CopyCost(token_s=1e-4, copy_s=0.1))  # a chunk computed: 0.05 s
    assert (copies, reused) == (0, 0)
    assert text == fresh


def test_a_prefix_that_pays_for_its_copy_is_copied(model_path: str, fresh: str) -> None:
    text, reused, copies = beside(model_path, CopyCost(token_s=1e-3, copy_s=0.1))  # a chunk computed: 0.5 s
    assert (copies, reused) == (1, PROMPT_CHUNK)
    assert text == fresh


def test_the_engine_measures_both_costs_as_it_loads_and_leaves_its_cells_empty(model_path: str, fresh: str) -> None:
    e = engine(model_path, 2)
    try:
        cost = e._cells.copy_cost
        assert cost.token_s > 0 and cost.copy_s > 0  # both measured: neither left at its default
        assert [e.kv_cells(slot) for slot in (0, 1)] == [0, 0]
        assert [e._context.seq_pos_min(slot) for slot in (0, 1)] == [-1, -1]  # nothing left in llama.cpp's memory
        assert serve(e, [(FOLLOWER, GenerateParams(max_tokens=12, temperature=0.0))])[0].text == fresh
    finally:
        e.close()
