"""Speculative decoding in the batched engine, by prompt lookup and by a draft model (tiny-draft, the tiny
model's first block; or the tiny model itself), on the tiny built-in model, in-process and through a
server: the output equals the same requests without speculation, token for token, while drafts really are
taken (and, from tiny-draft, some rejected)."""

from __future__ import annotations

import json
import socket
import subprocess
import tempfile
from pathlib import Path

import httpx
import llama_cpp
import numpy as np
import pytest
from conftest import ServerProcess
from engines import copying, serve
from helpers import http_up, mpserve, wait_for
from prometheus_client.parser import text_string_to_metric_families

from mpserve.config.speculative import Speculative
from mpserve.engine.batch import BatchEngine
from mpserve.engine.interface import Completion
from mpserve.engine.sequence import PROMPT_CHUNK
from mpserve.engine.settings import EngineSettings
from mpserve.engine.speculation import STORED_ROWS
from mpserve.errors import BadRequest
from mpserve.models import maker
from mpserve.models.builtin import builtin_model_path
from mpserve.wire.protocol import GenerateParams

pytestmark = pytest.mark.timeout(180)

N_CTX = 1024
PROMPTS = [
    "The quick brown fox",
    "Once upon a time in the land of",
    "the cat sat on the mat and the dog sat on the log and the cat sat on the",
    "In the beginning was the word, and the word was",
    "4 + 4 =",
    "It was the best of times, it was the worst of times, it was the age of",
    "one two three four five one two three four five one two",
    "Hello",
]
LONG_PROMPT = " ".join(f"the {w} of all and" for w in ("cat", "dog", "sea", "sky") * 30)  # 931 tokens


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(builtin_model_path("tiny"))


@pytest.fixture(scope="module")
def draft_path() -> str:
    return str(builtin_model_path("tiny-draft"))


def make_engine(model_path: str, parallel: int, speculative: Speculative | None,
                flash_attn: str = "auto") -> BatchEngine:
    return BatchEngine(EngineSettings(model_path, n_ctx=N_CTX, parallel=parallel, threads=1, n_gpu_layers=0,
                                      speculative=speculative, flash_attn=flash_attn,
                                      reuse="exact"))  # compared with fresh ones


def run(model_path: str, parallel: int, speculative: Speculative | None,
        requests: list[tuple[str, GenerateParams]], flash_attn: str = "auto") -> list[Completion]:
    engine = make_engine(model_path, parallel, speculative, flash_attn)
    try:
        return serve(engine, requests)
    finally:
        engine.close()


def same_output(a: list[Completion], b: list[Completion]) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x.text, x.finish_reason, x.completion_tokens) == (y.text, y.finish_reason, y.completion_tokens)


def drafting(path: str, **changes: object) -> Speculative:
    """A draft model that drafts n_max tokens whenever there are rows for them: on the tiny model the decodes
    are mostly overhead, so measured sizing would find that a draft as dear as the model never pays."""
    return Speculative(type="draft", model=path, n_max=4, sizing="fixed", **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("parallel", [1, 4])
def test_greedy_output_with_speculation_equals_without_and_drafts_are_taken(model_path: str, parallel: int) -> None:
    requests = [(p, GenerateParams(max_tokens=48, temperature=0.0)) for p in PROMPTS]
    plain = run(model_path, parallel, None, requests)
    # every third request does not speculate: sequences with and without drafts share the batch
    mixed = [(p, GenerateParams(max_tokens=48, temperature=0.0, speculative_n_max=0 if i % 3 == 2 else None))
             for i, p in enumerate(PROMPTS)]
    speculated = run(model_path, parallel, Speculative(), mixed)
    same_output(plain, speculated)
    assert all(c.draft_tokens == 0 for c in plain) and speculated[2].draft_tokens == 0
    assert sum(c.accepted_tokens for c in speculated) > 0  # the random weights repeat themselves a lot
    assert all(0 <= c.accepted_tokens <= c.draft_tokens for c in speculated)


@pytest.mark.parametrize("parallel", [1, 3])
def test_seeded_sampling_with_speculation_equals_without_and_is_reproducible(model_path: str,
                                                                              parallel: int) -> None:
    """The verified drafts are drawn with the sequence's own chain, once per kept token: with a seed, the
    very tokens of the unspeculated sampler (penalties, bias, top-k/p, min-p included), so their frequencies
    over many seeds are the same too."""
    requests = [(p, GenerateParams(max_tokens=40, temperature=0.9 if seed % 4 == 0 else 0.2, seed=seed, top_k=20,
                                   min_p=0.02, repeat_penalty=1.1 if seed % 2 else 1.0,
                                   logit_bias=((7, 2.0),) if seed % 3 else ()))
                for seed, p in enumerate(PROMPTS * 2)]
    plain = run(model_path, parallel, None, requests)
    speculated = run(model_path, parallel, Speculative(n_max=4), requests)
    same_output(plain, speculated)
    same_output(speculated, run(model_path, parallel, Speculative(n_max=4), requests))
    assert sum(c.accepted_tokens for c in speculated) > 0


def test_stop_strings_max_tokens_logprobs_and_grammars_are_unchanged(model_path: str) -> None:
    # flash attention off: on a CPU it sums V in f16, in the order of the cells a sequence's tokens sit in, and
    # removing rejected drafts puts later tokens in other cells, so log-probabilities would differ by up to 1e-4
    plain_first = run(model_path, 1, None, [(PROMPTS[2], GenerateParams(max_tokens=40, temperature=0.0))], "off")[0]
    stop = plain_first.text[20:24]  # a stop string the greedy text meets after some tokens
    requests = [
        (PROMPTS[2], GenerateParams(max_tokens=40, temperature=0.0, stop=(stop,))),
        (PROMPTS[6], GenerateParams(max_tokens=7, temperature=0.0)),
        (PROMPTS[5], GenerateParams(max_tokens=30, temperature=0.0, logprobs=3)),
        (PROMPTS[0], GenerateParams(max_tokens=30, temperature=0.0, grammar='root ::= ("ab" | "cd")+')),
    ]
    plain = run(model_path, 2, None, requests, "off")
    speculated = run(model_path, 2, Speculative(), requests, "off")
    same_output(plain, speculated)
    assert speculated[0].finish_reason == "stop" and stop not in speculated[0].text
    assert speculated[1].completion_tokens == 7
    a, b = plain[2].logprobs, speculated[2].logprobs
    assert a is not None and b is not None
    assert (a.tokens, a.top_tokens) == (b.tokens, b.top_tokens)
    # the tiny model's float weights give a row of a batch of several the numbers it gets alone to ~1e-6 only
    # (as for sequences decoded together); quantized weights give the very numbers (the real-model test)
    for x, y in ((a.logprobs, b.logprobs), (a.top_logprobs, b.top_logprobs)):
        assert np.allclose(np.frombuffer(x, "<f8"), np.frombuffer(y, "<f8"), atol=1e-4)
    assert set(speculated[3].text) <= set("abcd")


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_cancelling_mid_speculation_leaves_the_slot_reusable_with_its_cells_right(model_path: str,
                                                                                   kind: str) -> None:
    """on_token says stop at the second token one step gives (so the step was verifying drafts): the cells
    past the kept tokens are gone, and the slot's next request reuses its prompt's cells and gives what a
    fresh engine gives (its drafts taken again, from a draft model too)."""
    prompt = LONG_PROMPT[:1800]
    params = GenerateParams(max_tokens=60, temperature=0.0)
    fresh = run(model_path, 1, None, [(prompt, params)])[0]
    engine = make_engine(model_path, 1, Speculative() if kind == "ngram" else drafting(model_path))
    steps = [0]
    seen: list[int] = []  # the step each token came in

    def cancel_at_a_second_token_of_a_step(text: str, n: int) -> bool:
        seen.append(steps[0])
        return not (n > 5 and seen.count(steps[0]) == 2)

    try:
        engine.admit(0, prompt, params, cancel_at_a_second_token_of_a_step)
        done: dict[int, Completion] = {}
        while not done:
            done = dict(engine.step())
            steps[0] += 1
        cancelled = done[0]
        assert cancelled.finish_reason == "cancelled" and cancelled.accepted_tokens > 0
        assert fresh.text.startswith(cancelled.text)
        kept = len(engine._cells.cached[0])  # prompt and kept tokens with cells (the last token drawn has none)
        assert kept == cancelled.prompt_tokens + cancelled.completion_tokens - 1
        assert llama_cpp.llama_memory_seq_pos_max(engine._context.memory, 0) == kept - 1
        assert engine.best_slot(prompt) == (0, PROMPT_CHUNK)
        again = serve(engine, [(prompt, params)])[0]
        assert again.reused_tokens == PROMPT_CHUNK and again.text == fresh.text and again.accepted_tokens > 0
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_a_server_that_speculates_answers_http_streamed_and_not_with_the_unspeculated_text(
        model_path: str, draft_path: str, kind: str) -> None:
    """Through the gateway: the same text streamed and not as the engine gives without speculation, the
    drafts in each response's timings, and the acceptance in /metrics; by prompt lookup, or by a draft
    model (the --speculative draft:PATH spelling)."""
    requests = [(p, GenerateParams(max_tokens=32, temperature=0.0)) for p in PROMPTS[2:5]]
    expected = run(model_path, 1, None, requests)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    # tiny-draft costs about what tiny costs (the decodes are mostly overhead): measured sizing would not draft
    setting = "ngram" if kind == "ngram" else f"{{type: draft, model: {draft_path}, sizing: fixed}}"
    server = ServerProcess("--parallel", "2", "--threads", "1", "--n-ctx", str(N_CTX), "--speculative", setting,
                           "--reuse", "exact", "--http", f"127.0.0.1:{port}").wait_ready()
    try:
        wait_for(lambda: http_up(url), 30, "the gateway answers /health")
        drafted = accepted = 0
        for (prompt, _), want in zip(requests, expected, strict=True):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 32, "temperature": 0}
            whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
            assert whole["choices"][0]["text"] == want.text
            timings = whole["timings"]
            assert 0 <= timings["accepted_tokens"] <= timings["draft_tokens"]
            drafted += timings["draft_tokens"]
            accepted += timings["accepted_tokens"]
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                events = [json.loads(line[5:]) for line in r.iter_lines()
                          if line.startswith("data:") and line != "data: [DONE]"]
            assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == want.text
        assert accepted > 0
        samples = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
                   for s in f.samples if s.labels.get("model") == "tiny"}
        assert samples["mpserve_draft_tokens_total"] >= drafted
        assert 0 < samples["mpserve_draft_acceptance_ratio"] <= 1
    finally:
        server.stop()


def test_a_request_may_draft_less_or_not_at_all(model_path: str) -> None:
    requests = [(PROMPTS[2], GenerateParams(max_tokens=40, temperature=0.0, speculative_n_max=n)) for n in (0, 1, None)]
    off, one, model_default = run(model_path, 1, Speculative(), requests)
    assert off.draft_tokens == 0 and one.accepted_tokens > 0 and model_default.accepted_tokens > 0
    assert off.text == one.text == model_default.text
    with pytest.raises(BadRequest, match="speculative_n_max"):
        GenerateParams.from_wire({"speculative_n_max": 65})


@pytest.mark.parametrize("exact", [True, False])
def test_a_decode_verifies_more_rows_than_the_exact_bound_only_with_exact_false(model_path: str,
                                                                                exact: bool) -> None:
    """With ``exact`` a decode holds at most STORED_ROWS rows (float weights: none repacked), whatever n_max asks;
    with ``exact: false`` it holds as many drafts as n_max and the lookup give."""
    engine = make_engine(model_path, 1, Speculative(n_max=12, sizing="fixed", exact=exact))
    rows: list[int] = []
    observe = engine._row_costs.observe
    engine._row_costs.observe = lambda n, seconds: (rows.append(n), observe(n, seconds))[1]
    try:
        done = serve(engine, [(PROMPTS[6], GenerateParams(max_tokens=48, temperature=0.0))])
    finally:
        engine.close()
    assert done[0].accepted_tokens > 0
    assert (max(rows) <= STORED_ROWS) if exact else (max(rows) > STORED_ROWS), rows


# --- a draft model ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("parallel", [1, 4])
def test_greedy_output_with_a_draft_model_equals_without_with_drafts_taken_and_rejected(
        model_path: str, draft_path: str, parallel: int) -> None:
    requests = [(p, GenerateParams(max_tokens=48, temperature=0.0)) for p in PROMPTS]
    plain = run(model_path, parallel, None, requests)
    mixed = [(p, GenerateParams(max_tokens=48, temperature=0.0, speculative_n_max=0 if i % 3 == 2 else None))
             for i, p in enumerate(PROMPTS)]
    drafted = run(model_path, parallel, drafting(draft_path), mixed)
    same_output(plain, drafted)
    assert drafted[2].draft_tokens == 0
    proposed, taken = sum(c.draft_tokens for c in drafted), sum(c.accepted_tokens for c in drafted)
    assert 0 < taken < proposed  # the first block alone often, not always, picks what both blocks pick


@pytest.mark.parametrize("parallel", [1, 4])
def test_a_draft_model_that_is_the_model_itself_has_every_draft_taken(model_path: str, parallel: int) -> None:
    """The draft computes each token in the decodes the model computes it in (a long prompt's chunks too), so
    its greedy choices are the model's."""
    requests = [(p, GenerateParams(max_tokens=32, temperature=0.0)) for p in [*PROMPTS, LONG_PROMPT, PROMPTS[0]]]
    plain = run(model_path, parallel, None, requests)
    drafted = run(model_path, parallel, drafting(model_path), requests)
    same_output(plain, drafted)
    assert all(c.accepted_tokens == c.draft_tokens for c in drafted), [(c.draft_tokens, c.accepted_tokens)
                                                                       for c in drafted]
    assert sum(c.draft_tokens for c in drafted) > 0


def test_seeded_sampling_with_a_draft_model_equals_without_and_is_reproducible(model_path: str,
                                                                               draft_path: str) -> None:
    requests = [(p, GenerateParams(max_tokens=40, temperature=0.9 if seed % 2 else 0.3, seed=seed, top_k=20,
                                   repeat_penalty=1.1 if seed % 3 else 1.0)) for seed, p in enumerate(PROMPTS * 2)]
    plain = run(model_path, 3, None, requests)
    drafted = run(model_path, 3, drafting(draft_path), requests)
    same_output(plain, drafted)
    same_output(drafted, run(model_path, 3, drafting(draft_path), requests))
    assert sum(c.accepted_tokens for c in drafted) > 0


def test_the_draft_keeps_up_with_reused_copied_cached_and_carried_tokens(model_path: str, draft_path: str) -> None:
    """Prompts sharing a long prefix: a slot reuses its own cells, copies another slot's, restores the prompt
    cache's; then a request resumed from tokens carried over from a lost instance. The draft model follows
    each by the common prefix of its tokens, and the output is unchanged."""
    shared = [LONG_PROMPT[:1800] + tail for tail in (" the cat", " a dog", " the cat sat")]
    others = ["Zebra " + LONG_PROMPT[:1800], "Yak " + LONG_PROMPT[:1800]]  # they push the shared prefix out
    prompts = [*shared[:2], *others, shared[2], LONG_PROMPT[:900] + " and", shared[0]]
    requests = [(p, GenerateParams(max_tokens=24, temperature=0.0)) for p in prompts]
    plain = run(model_path, 2, None, requests)
    engine = copying(BatchEngine(EngineSettings(model_path, n_ctx=N_CTX, parallel=2, threads=1, n_gpu_layers=0,
                                                speculative=drafting(draft_path), cache_ram=64 << 20,
                                                cache_shm=tempfile.mkdtemp(), reuse="exact")))
    try:
        drafted = serve(engine, requests)
        stats, cache = engine.stats(), engine.cache_stats()
        prompt, params, carried = "Zebra " + shared[2], GenerateParams(max_tokens=24, temperature=0.0), list[int]()

        def lost_after_12_tokens(text: str, n: int) -> bool:
            carried[:] = engine.tokens(1)
            return n < 12

        engine.admit(1, prompt, params, lost_after_12_tokens)
        while engine.active:
            engine.step()
        engine.admit(0, prompt, params, lambda text, n: True, carried)  # resumed in the other slot
        resumed: dict[int, Completion] = {}
        while engine.active:
            resumed.update(engine.step())
    finally:
        engine.close()
    same_output(plain, drafted)
    assert stats.prefix_copies > 0 and stats.prompt_tokens_reused > 0 and stats.accepted_tokens > 0
    assert cache.hits > 0 and stats.prompt_tokens_restored > 0
    assert len(carried) == 12 and resumed[0].text == run(model_path, 1, None, [(prompt, params)])[0].text
    assert resumed[0].accepted_tokens > 0


def test_the_draft_keeps_a_slots_cells_for_requests_of_the_same_reuse_key_only(model_path: str,
                                                                               draft_path: str) -> None:
    """Tenant B's request leaves its prompt's cells in the draft; tenant A's request with B's very prompt (a
    guess at it) starts the draft from none of them, as it starts the model from none, while B's next request
    starts from them: the draft's cells are keyed as the slot's (the salt, with the adapters' loads)."""
    prompt, params = LONG_PROMPT[:1800], GenerateParams(max_tokens=12, temperature=0.0)
    engine = make_engine(model_path, 1, drafting(draft_path))
    draft = engine._draft
    assert draft is not None
    kept: list[int] = []  # per draft sync: the prompt tokens whose draft cells a sequence started from
    sync = draft._sync
    draft._sync = lambda want: (kept.append(start := sync(want)), start)[1]  # type: ignore[method-assign]

    def draft_start(salt: bytes) -> int:
        kept.clear()
        engine.admit(0, prompt, params, lambda text, n: True, salt=salt)
        while engine.active:
            engine.step()
        return kept[0]

    try:
        assert draft_start(b"tenant B".ljust(16)) == 0
        assert draft_start(b"tenant B".ljust(16)) >= PROMPT_CHUNK  # the same key: the draft keeps its prompt
        assert draft_start(b"tenant A".ljust(16)) == 0  # another tenant's guess: nothing of B's
        assert draft_start(b"tenant B".ljust(16)) == 0  # nor does B get A's back
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_a_missing_draft_or_one_with_another_vocabulary_stops_the_start_before_anything_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def start(setting: str) -> subprocess.CompletedProcess[str]:
        return mpserve("start", "--server-name", f"d{tmp_path.name[-8:]}", "--speculative", setting, timeout=30)

    missing = start("draft:/no/such/draft.gguf")
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert "speculative.model: no such draft model file '/no/such/draft.gguf'" in missing.stderr
    tokens = maker.vocabulary()
    monkeypatch.setattr(maker, "vocabulary", lambda: tokens[:-1])
    other = start(f"draft:{maker.write_model(tmp_path / 'other.gguf', 'tiny-draft')}")
    assert other.returncode == 1 and "Traceback" not in other.stderr and "ready:" not in other.stdout
    assert (f"the draft model {tmp_path / 'other.gguf'} does not have the vocabulary of "
            f"{builtin_model_path('tiny')}: {len(tokens) - 1} tokens against {len(tokens)}") in other.stderr
