"""The batched engine: K sequences in one llama.cpp context, on the tiny built-in model, in-process."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import pytest
from engines import LONG_PROMPT, N_CTX, PROMPTS, copying, finish, make_engine, make_llama, serve

from mpserve.engine.batch import BatchEngine
from mpserve.engine.interface import Completion
from mpserve.engine.sampling import TextStream
from mpserve.engine.sequence import PROMPT_CHUNK
from mpserve.engine.settings import EngineSettings
from mpserve.errors import BadRequest
from mpserve.models.builtin import builtin_model_path
from mpserve.wire.protocol import GenerateParams

REPO = Path(__file__).resolve().parent.parent
LENGTHS = [8, 40, 17, 64, 3, 29]


def greedy(max_tokens: int, **kw: object) -> GenerateParams:
    return GenerateParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(builtin_model_path("tiny"))


@pytest.fixture(scope="module")
def llm(model_path: str) -> Iterator[llama_cpp.Llama]:
    llm = make_llama(model_path)
    yield llm
    llm.close()


class Recorder:
    """on_token for one request: keeps the pieces and the step each call came in."""

    def __init__(self, clock: list[int], cancel_after: int | None = None) -> None:
        self.clock = clock
        self.pieces: list[str] = []
        self.steps: list[int] = []
        self.cancel_after = cancel_after

    def __call__(self, text: str, tokens: int) -> bool:
        self.pieces.append(text)
        self.steps.append(self.clock[0])
        return self.cancel_after is None or tokens < self.cancel_after


def one_at_a_time(model_path: str, requests: list[tuple[str, GenerateParams]], flash_attn: str = "off"
                  ) -> list[Completion]:
    engine = make_engine(model_path, 1, flash_attn=flash_attn)
    try:
        return serve(engine, requests)
    finally:
        engine.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("kv_unified", "flash_attn"), [(False, "off"), (True, "off"), (False, "auto"), (True, "on")],
                         ids=["kv-per-slot", "kv-unified", "kv-per-slot-flash-attn-auto", "kv-unified-flash-attn"])
def test_greedy_four_at_once_equals_one_at_a_time_and_create_completion(
        model_path: str, kv_unified: bool, flash_attn: str) -> None:
    requests = [(p, greedy(n)) for p, n in zip(PROMPTS + PROMPTS[:2], LENGTHS + [33, 5], strict=True)]
    engine = make_engine(model_path, 4, kv_unified=kv_unified, flash_attn=flash_attn)
    try:
        batched = serve(engine, requests)
    finally:
        engine.close()
    alone = one_at_a_time(model_path, requests, flash_attn=flash_attn)
    llm = make_llama(model_path, flash_attn=flash_attn)  # the same attention kernel as the engine
    try:
        for (prompt, params), b, a in zip(requests, batched, alone, strict=True):
            reference = llm.create_completion(prompt, max_tokens=params.max_tokens, temperature=0)
            assert b.text == a.text == reference["choices"][0]["text"], prompt
            assert b.finish_reason == "length" and b.completion_tokens == params.max_tokens
            assert b.prompt_tokens == reference["usage"]["prompt_tokens"]
    finally:
        llm.close()


@pytest.mark.timeout(60)
def test_seeded_sampling_is_reproducible_and_independent_of_the_rest_of_the_batch(
        model_path: str, llm: llama_cpp.Llama) -> None:
    sampled = GenerateParams(max_tokens=40, temperature=0.8, seed=1234)
    alone = one_at_a_time(model_path, [(PROMPTS[1], sampled)])[0]
    others = [(PROMPTS[0], greedy(50)), (PROMPTS[3], GenerateParams(max_tokens=50, temperature=1.2, seed=7)),
              (PROMPTS[5], GenerateParams(max_tokens=50, temperature=0.8, seed=1234))]
    engine = make_engine(model_path, 4)
    try:
        in_batch = serve(engine, [others[0], (PROMPTS[1], sampled), *others[1:]])[1]
        again = serve(engine, [(PROMPTS[1], sampled)])[0]
    finally:
        engine.close()
    greedy_text = one_at_a_time(model_path, [(PROMPTS[1], greedy(40))])[0].text
    assert in_batch.text == alone.text == again.text != greedy_text
    reference = llm.create_completion(PROMPTS[1], max_tokens=40, temperature=0.8, seed=1234)
    assert alone.text == reference["choices"][0]["text"]


@pytest.mark.timeout(60)
def test_a_long_prompt_does_not_stall_decoding_sequences(model_path: str, llm: llama_cpp.Llama) -> None:
    budget = 64
    engine = make_engine(model_path, 4, budget=budget)
    clock = [0]
    try:
        decoding = {slot: Recorder(clock) for slot in range(3)}
        for slot, recorder in decoding.items():
            engine.admit(slot, PROMPTS[slot], greedy(30), recorder)
        engine.step()  # their prompts, and the first token of each
        clock[0] += 1
        long_one = Recorder(clock)
        engine.admit(3, LONG_PROMPT, greedy(4), long_one)
        before = engine.stats().prompt_tokens_computed
        finished: dict[int, Completion] = {}
        while engine.active:
            computed = engine.stats().prompt_tokens_computed
            finished.update(engine.step())
            assert engine.stats().prompt_tokens_computed - computed <= PROMPT_CHUNK  # one chunk per step
            clock[0] += 1
    finally:
        engine.close()
    long_done = finished[3]
    assert long_done.prompt_tokens >= 600
    assert engine.stats().prompt_tokens_computed - before == long_done.prompt_tokens
    prefill_steps = -(-long_done.prompt_tokens // PROMPT_CHUNK)
    assert long_one.steps[0] == 1 + prefill_steps - 1  # the first token comes with the last prompt chunk
    for recorder in decoding.values():  # one token on every step, the prompt's steps included
        assert recorder.steps[:prefill_steps + 1] == list(range(prefill_steps + 1))
    # a prompt computed in chunks gives what create_completion gives: it computes the same chunks
    assert long_done.text == llm.create_completion(LONG_PROMPT, max_tokens=4, temperature=0)["choices"][0]["text"]
    for slot in decoding:
        reference = llm.create_completion(PROMPTS[slot], max_tokens=30, temperature=0)["choices"][0]["text"]
        assert finished[slot].text == reference


@pytest.mark.timeout(60)
def test_a_newcomers_first_token_comes_before_the_decoding_rows_next_ones(model_path: str,
                                                                          llm: llama_cpp.Llama) -> None:
    engine = make_engine(model_path, 2)
    try:
        engine.admit(0, PROMPTS[0], greedy(20), lambda text, n: True)
        engine.step()  # its prompt and first token
        engine.step()
        engine.admit(1, PROMPTS[1], greedy(10), lambda text, n: True)
        engine.step()  # the newcomer's prompt alone: its first token, before the decoding row's third
        assert (len(engine.tokens(0)), len(engine.tokens(1))) == (2, 1)
        engine.step()
        assert (len(engine.tokens(0)), len(engine.tokens(1))) == (3, 2)
        done = finish(engine)
    finally:
        engine.close()
    for slot, (prompt, n) in enumerate([(PROMPTS[0], 20), (PROMPTS[1], 10)]):  # numbers unchanged by the order
        assert done[slot].text == llm.create_completion(prompt, max_tokens=n, temperature=0)["choices"][0]["text"]


@pytest.mark.timeout(60)
def test_cancel_frees_the_slot_within_one_step_and_leaves_the_others_unchanged(model_path: str) -> None:
    requests = [(p, greedy(40)) for p in PROMPTS[:4]]
    expected = one_at_a_time(model_path, requests)
    engine = make_engine(model_path, 4)
    clock = [0]
    try:
        recorders = [Recorder(clock, cancel_after=12 if slot == 2 else None) for slot in range(4)]
        for slot, ((prompt, params), recorder) in enumerate(zip(requests, recorders, strict=True)):
            engine.admit(slot, prompt, params, recorder)
        results: dict[int, Completion] = {}
        for _ in range(5):
            results.update(engine.step())
        engine.cancel(1)  # from outside, between steps
        results.update(engine.step())
        assert 1 in results and 1 in engine.free_slots()
        while engine.active:
            results.update(engine.step())
            if 2 in results:
                assert 2 in engine.free_slots()
    finally:
        engine.close()
    assert results[1].finish_reason == "cancelled" and results[1].completion_tokens == 5
    assert expected[1].text.startswith(results[1].text)
    assert results[2].finish_reason == "cancelled" and results[2].completion_tokens == 12  # on_token said stop
    for slot in (0, 3):
        assert results[slot].finish_reason == "length"
        assert results[slot].text == expected[slot].text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kv_unified", [False, True], ids=["kv-per-slot", "kv-unified"])
def test_a_repeated_long_prompt_reuses_the_slots_cached_prefix(model_path: str, kv_unified: bool) -> None:
    first = LONG_PROMPT[:1800]
    follow_up = first + " and then the cat sat"
    fresh = one_at_a_time(model_path, [(follow_up, greedy(20))])[0]
    engine = make_engine(model_path, 2, kv_unified=kv_unified)
    try:
        serve(engine, [(first, greedy(20)), (PROMPTS[0], greedy(5))])  # slot 0: long prompt; slot 1: short
        slot, reusable = engine.best_slot(follow_up)
        assert slot == 0 and reusable == PROMPT_CHUNK  # whole chunks only: the rest is computed as fresh
        assert engine.best_slot(LONG_PROMPT[:1000] + " the end")[1] == 0  # it shares less than a chunk
        before = engine.stats().prompt_tokens_computed
        engine.admit(slot, follow_up, greedy(20), lambda text, n: True)
        done = dict(engine.step())
        while not done:
            done = dict(engine.step())
        again = done[slot]
        computed = engine.stats().prompt_tokens_computed - before
        assert again.reused_tokens == reusable
        assert computed == again.prompt_tokens - again.reused_tokens
        assert again.text == fresh.text  # reusing the cells changes nothing in the output
        assert engine.best_slot(follow_up) == (slot, PROMPT_CHUNK)  # its own last chunk is not whole
        engine.admit(slot, follow_up, greedy(20), lambda text, n: True)
        done = dict(engine.step())
        while not done:
            done = dict(engine.step())
        assert done[slot].reused_tokens == PROMPT_CHUNK and done[slot].text == fresh.text
    finally:
        engine.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kv_unified", [False, True], ids=["kv-per-slot", "kv-unified"])
@pytest.mark.parametrize("holder_running", [False, True], ids=["holder-finished", "holder-running"])
def test_a_prefix_another_slot_holds_is_copied_not_computed(model_path: str, kv_unified: bool,
                                                            holder_running: bool) -> None:
    preamble = LONG_PROMPT[:1800]
    follow_up = preamble + " and then the cat sat"
    fresh = one_at_a_time(model_path, [(follow_up, greedy(20))])[0]
    engine = make_engine(model_path, 2, kv_unified=kv_unified)
    try:
        engine.admit(0, preamble, greedy(40 if holder_running else 3), lambda text, n: True)
        while engine.active and not (holder_running and engine.stats().generated_tokens >= 5):
            engine.step()
        assert (engine.active == 1) == holder_running
        before = engine.stats()
        engine.admit(1, follow_up, greedy(20), lambda text, n: True)  # slot 1 holds nothing of it
        done: dict[int, Completion] = {}
        while 1 not in done:
            done.update(engine.step())
        after = engine.stats()
        copied = done[1]
        assert after.prefix_copies - before.prefix_copies == 1
        assert copied.reused_tokens == PROMPT_CHUNK
        computed = after.prompt_tokens_computed - before.prompt_tokens_computed
        assert computed == copied.prompt_tokens - copied.reused_tokens
        assert copied.text == fresh.text  # copied cells change nothing in the output
        if holder_running:  # and the slot they came from goes on as if nothing happened
            while 0 not in done:
                done.update(engine.step())
            alone = one_at_a_time(model_path, [(preamble, greedy(40))])[0]
            assert done[0].text == alone.text
    finally:
        engine.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kv_unified", [False, True], ids=["kv-per-slot", "kv-unified"])
def test_prompts_admitted_together_compute_their_shared_prefix_once(model_path: str, kv_unified: bool) -> None:
    preamble = LONG_PROMPT[:1800]
    requests = [(preamble + ending, greedy(20)) for ending in (" and then the cat sat", " so the dog ran off")]
    fresh = one_at_a_time(model_path, requests)
    engine = make_engine(model_path, 2, kv_unified=kv_unified)
    try:
        together = serve(engine, requests)  # both admitted before the first step: neither holds cells yet
        stats = engine.stats()
    finally:
        engine.close()
    assert [r.text for r in together] == [r.text for r in fresh]
    assert together[0].reused_tokens == 0
    assert together[1].reused_tokens == PROMPT_CHUNK  # it waited for the other's first chunk, then copied it
    assert stats.prefix_copies == 1
    assert stats.prompt_tokens_computed == sum(r.prompt_tokens - r.reused_tokens for r in together)


@pytest.mark.timeout(300)
def test_exact_holds_when_long_prompts_sharing_a_preamble_run_at_once(model_path: str) -> None:
    """Five prompts sharing a preamble longer than a chunk, four slots, run at once with ``reuse: exact``: each
    token and its log-probability equal a fresh computation's. With contexts past 256 cells, llama.cpp's CPU
    flash attention computes a lone query with a kernel of its own (its cells split among the threads), so a
    long sequence decoded in one batch with others got other numbers than alone."""
    preamble = LONG_PROMPT[:2400]
    requests = [(preamble + ending, greedy(12, logprobs=1))
                for ending in (" and then", " so the dog", " but the sea", " or a sky", " the end")]

    def engine(parallel: int) -> BatchEngine:  # two threads: one thread computes a lone query as a batch does
        return copying(BatchEngine(EngineSettings(model_path, n_ctx=N_CTX, parallel=parallel, threads=1,
                                                  n_gpu_layers=0, reuse="exact")))

    fresh = []
    alone = engine(1)
    try:
        for request in requests:
            alone.erase_slot(0)
            fresh.extend(serve(alone, [request]))
    finally:
        alone.close()
    together = engine(4)
    try:
        at_once = serve(together, requests)
    finally:
        together.close()
    assert [r.reused_tokens for r in at_once].count(PROMPT_CHUNK) >= 3  # the preamble's chunk, copied
    assert all(r.prompt_tokens > 2 * 256 for r in at_once)
    for a, f in zip(at_once, fresh, strict=True):
        assert a.text == f.text
        assert a.logprobs == f.logprobs


@pytest.mark.timeout(120)
def test_reuse_any_starts_from_a_shared_prefix_of_any_length_generated_tokens_included(model_path: str) -> None:
    """``reuse: any``: the next turn of a chat computes only what is new (the reply's cells are reused), a prompt
    shorter than what a slot holds reuses all but its last token, and another slot's cells are copied at any
    length (where the copy costs less than computing them: here, always)."""
    # reuse: any, the default
    engine = copying(BatchEngine(EngineSettings(model_path, n_ctx=N_CTX, parallel=2, threads=1, n_gpu_layers=0)))
    try:
        first = serve(engine, [(PROMPTS[3], greedy(24))])[0]
        turn = PROMPTS[3] + first.text + " And then"
        slot, reusable = engine.best_slot(turn)
        assert reusable > first.prompt_tokens  # the reply's cells too
        before = engine.stats()
        second = serve(engine, [(turn, greedy(8))])[0]
        after = engine.stats()
        assert second.reused_tokens == reusable
        assert after.prompt_tokens_computed - before.prompt_tokens_computed == second.prompt_tokens - reusable
        shorter = PROMPTS[3][:20]
        held = engine.best_slot(shorter)
        assert held[1] == len(engine._context.tokenize_prompt(shorter)) - 1  # the last prompt token is computed again
        copies = engine.stats().prefix_copies
        engine.admit(1 - slot, turn + " more", greedy(4), lambda text, n: True)  # the other slot: copied over
        while engine.active:
            engine.step()
        assert engine.stats().prefix_copies == copies + 1
        assert engine.kv_cells(1 - slot) > second.prompt_tokens
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_a_stop_string_ends_the_sequence_before_it(model_path: str, llm: llama_cpp.Llama) -> None:
    full = one_at_a_time(model_path, [(PROMPTS[0], greedy(40))])[0].text
    stop = full[20:24]
    engine = make_engine(model_path, 2)
    clock = [0]
    streamed = Recorder(clock)
    try:
        engine.admit(0, PROMPTS[0], greedy(40, stop=("never appears", stop)), streamed)
        engine.admit(1, PROMPTS[1], greedy(40), Recorder(clock))
        results: dict[int, Completion] = {}
        while engine.active:
            results.update(engine.step())
    finally:
        engine.close()
    stopped = results[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[:full.index(stop)]
    assert "".join(streamed.pieces) == stopped.text  # nothing streamed had to be taken back
    assert results[1].finish_reason == "length"
    reference = llm.create_completion(PROMPTS[0], max_tokens=40, temperature=0, stop=["never appears", stop])
    assert stopped.text == reference["choices"][0]["text"]


def run_capturing_tokens(engine: BatchEngine, prompt: str, params: GenerateParams,
                         carried: list[int] | None = None) -> tuple[Completion, list[str], list[int]]:
    """One request in slot 0; its streamed pieces and the token ids it generated (``engine.tokens``)."""
    pieces: list[str] = []
    generated: list[int] = []

    def on_token(text: str, tokens: int) -> bool:
        pieces.append(text)
        generated[:] = engine.tokens(0)
        return True

    engine.admit(0, prompt, params, on_token, carried or [])
    while True:
        for _, completion in engine.step():
            return completion, pieces, generated


def resume_counting_steps(engine: BatchEngine, prompt: str, params: GenerateParams, carried: list[int],
                          cancel_at: int = 0) -> tuple[Completion, list[str], int]:
    """``carried`` resumed in slot 0 of ``engine`` while slot 1 decodes a long request of its own (if free): the
    completion, its streamed pieces and the steps it took. ``cancel_at``: its on_token asks to stop there."""
    pieces: list[str] = []
    if 1 in engine.free_slots():
        engine.admit(1, "It was the best of times", greedy(2000), lambda text, n: True)
    engine.admit(0, prompt, params, lambda text, n: pieces.append(text) is None and n != cancel_at, carried)
    for steps in itertools.count(1):
        for slot, completion in engine.step():
            if slot == 0:
                return completion, pieces, steps
    raise AssertionError("unreachable")


@pytest.mark.timeout(60)
def test_with_reuse_any_carried_tokens_are_decoded_in_runs_and_the_stream_goes_on_where_it_was_cut(
        model_path: str) -> None:
    """``reuse: any`` (the default): a resumed request decodes its carried tokens a run a step (the step's prompt
    budget while another sequence decodes), not one a step: it goes on within a few steps. Nothing reaches the client
    twice, nothing is missing; a cancel inside a run leaves the cells decoding one a step would."""
    prompt, params, cut = "Once upon a time", greedy(300), 250
    settings = EngineSettings(model_path, n_ctx=N_CTX, parallel=2, threads=1, n_gpu_layers=0)
    assert not settings.exact  # the default
    engine = BatchEngine(settings)
    try:
        whole, whole_pieces, tokens = run_capturing_tokens(engine, prompt, params)
        sent = "".join(whole_pieces[:cut])
        resumed, pieces, steps = resume_counting_steps(engine, prompt, params, tokens[:cut])
        assert resumed.finish_reason == whole.finish_reason == "length"
        assert resumed.completion_tokens == 300 and resumed.text.startswith(sent)
        assert sent + "".join(pieces) == resumed.text
        # one a step: 1 prompt step, 250 carried, 50 sampled; in runs of the budget (64): about 1 + 4 + 50
        assert steps <= 1 + -(-cut // 64) + 1 + (300 - cut), steps
        cancelled, _, _ = resume_counting_steps(engine, prompt, params, tokens[:cut], cancel_at=100)
        assert cancelled.finish_reason == "cancelled" and cancelled.completion_tokens == 100
        prompt_tokens = cancelled.prompt_tokens
        assert engine.kv_cells(0) == prompt_tokens + 99  # the 100th taken, not decoded: as one a step leaves it
    finally:
        engine.close()
    exact = make_engine(model_path, 2)  # the same cancel, one a step
    try:
        resume_counting_steps(exact, prompt, params, tokens[:cut], cancel_at=100)
        assert exact.kv_cells(0) == prompt_tokens + 99
    finally:
        exact.close()


@pytest.mark.timeout(60)
def test_a_sequence_resumed_from_carried_tokens_continues_as_if_never_interrupted(model_path: str) -> None:
    """What a mid-stream failover does: the prompt plus the tokens already generated, elsewhere (through
    ``tokens``, as the worker reports them, an end-of-generation token included), with ``reuse: exact``
    (``make_engine``). With flash attention (on by default on a CPU) and a long run, a batched prefill of the
    carried tokens would turn a greedy choice at a near-tie; they are decoded one a step instead."""
    prompt = "Once upon a time"  # 500 greedy tokens: cut at 310, a batched prefill chose otherwise at 310
    full_text = one_at_a_time(model_path, [(prompt, greedy(40))])[0].text
    stop = full_text[30:34]  # a stop string after the cut: the text held back at the cut is handled
    for params in (greedy(500), greedy(40, stop=("never appears", stop)), greedy(40, repeat_penalty=1.3)):
        engine = make_engine(model_path, 1, flash_attn="auto")
        try:
            whole, whole_pieces, tokens = run_capturing_tokens(engine, prompt, params)
            # len(tokens): the lost instance had sent all its text, and died before its answer
            for cut in sorted({1, 9, min(310, len(tokens) - 1), len(tokens) - 1, len(tokens)}):
                sent = "".join(whole_pieces[:cut])  # what the client had when the first instance died
                resumer = make_engine(model_path, 1, flash_attn="auto")
                try:
                    resumed, pieces, _ = run_capturing_tokens(resumer, prompt, params, tokens[:cut])
                finally:
                    resumer.close()
                assert resumed.text == whole.text and resumed.finish_reason == whole.finish_reason, (params, cut)
                assert sent + "".join(pieces) == whole.text  # nothing repeated, nothing missing
                assert (resumed.prompt_tokens, resumed.completion_tokens) == (whole.prompt_tokens,
                                                                              whole.completion_tokens)
        finally:
            engine.close()
    engine = make_engine(model_path, 1)
    try:
        with pytest.raises(BadRequest, match="more than the 3 to generate"):
            engine.admit(0, prompt, greedy(3), lambda t, n: True, tokens[:4])
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_a_prompt_longer_than_the_context_is_a_bad_request(model_path: str) -> None:
    engine = BatchEngine(EngineSettings(model_path, n_ctx=64, parallel=2, threads=1, n_gpu_layers=0))
    try:
        with pytest.raises(BadRequest):
            engine.admit(0, LONG_PROMPT, greedy(4), lambda text, n: True)
        assert engine.free_slots() == [0, 1]
        engine.admit(0, PROMPTS[0], greedy(100), lambda text, n: True)  # max_tokens shrinks to fit n_ctx
        done = dict(engine.step())
        while not done:
            done = dict(engine.step())
        assert done[0].prompt_tokens + done[0].completion_tokens == 64
    finally:
        engine.close()


@pytest.mark.timeout(10)
def test_text_stream_keeps_utf8_characters_whole_and_holds_back_stop_prefixes() -> None:
    stream = TextStream(("<end>",))
    data = "é<e".encode()
    assert stream.push(data[:1]) == ("", False)  # half a character
    assert stream.push(data[1:]) == ("é", False)  # '<' and 'e' may start "<end>"
    assert stream.push(b"x") == ("<ex", False)  # they did not
    assert stream.push(b"ab<en") == ("ab", False)
    assert stream.push(b"d> more") == ("", True)
    assert TextStream((), strip_leading_space=True).push(b" hi") == ("hi", False)


@pytest.mark.timeout(120)
def test_the_batch_bench_harness_runs() -> None:
    run = subprocess.run([sys.executable, "-m", "bench.batch_bench", "--quick", "--ks", "1,2", "--no-llama-server",
                          "--threads", "1"], cwd=REPO, capture_output=True, text=True, timeout=110)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "| 1 |" in run.stdout and "| 2 |" in run.stdout
    assert "BatchEngine 2/2" in run.stdout  # batched greedy texts equal one at a time
