"""Echo with log-probabilities: the prompt's tokens scored by the engine against ``Llama(logits_all=True)``'s
scores, on the ZeroMQ path, and over HTTP in OpenAI's shape (and llama-cpp-python's), streamed and not."""

from __future__ import annotations

import math

import httpx
import llama_cpp
import numpy as np
import pytest
from conftest import RealModel, ServerProcess
from engines import LONG_PROMPT, PROMPTS, make_engine, scoring_llama, serve
from gateway_thread import GatewayThread

from mpserve import Client
from mpserve.engine.batch import BatchEngine
from mpserve.engine.sequence import PROMPT_CHUNK
from mpserve.engine.settings import EngineSettings
from mpserve.errors import BadRequest
from mpserve.models.builtin import builtin_model_path
from mpserve.wire import protocol as wire
from mpserve.wire.protocol import GenerateParams

TOP = 3


def log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    return row - (row.max() + np.log(np.exp(row - row.max()).sum()))


def check_prompt(llm: llama_cpp.Llama, prompt: str | list[int], lp: wire.Logprobs | None, max_tokens: int) -> None:
    """The first ``lp.prompt`` entries are the prompt's tokens (a leading BOS left out), each scored from the
    row of the token before it within 1e-4; the rest are the completion's ``max_tokens``."""
    llm.create_completion(prompt, max_tokens=max_tokens, temperature=0)
    n_prompt = len(prompt) if isinstance(prompt, list) else len(llm.tokenize(prompt.encode(), special=True))
    tokens = list(llm._input_ids[:n_prompt])
    skip = 1 if tokens[0] == llm.token_bos() else 0
    assert lp is not None and lp.prompt == n_prompt - skip
    entries = lp.entries()
    assert len(entries) == lp.prompt + max_tokens
    for j, (token, piece, logprob, top) in zip(range(skip, n_prompt), entries, strict=False):
        assert token == tokens[j] and piece == llm.detokenize([token])
        if j == 0:  # nothing precedes it
            assert math.isnan(logprob) and [t for t, _, _ in top] == [-1] * TOP
            continue
        expected = log_softmax(llm.scores[j - 1])
        assert abs(expected[token] - logprob) < 1e-4, j
        assert [t for t, _, _ in top] == list(np.argsort(-expected, kind="stable")[:TOP])
        assert all(abs(expected[t] - v) < 1e-4 for t, _, v in top)
    for i, (token, _, logprob, _) in enumerate(entries[lp.prompt:]):  # the completion's, as without echo
        assert abs(log_softmax(llm.scores[n_prompt - 1 + i])[token] - logprob) < 1e-4


@pytest.mark.timeout(180)
def test_the_engine_scores_every_prompt_token_and_reuses_no_cells() -> None:
    path = str(builtin_model_path("tiny"))
    llm = scoring_llama(path, flash_attn=False)
    engine = make_engine(path, 2)
    asked = GenerateParams(max_tokens=4, temperature=0, logprobs=TOP, prompt_logprobs=True)
    try:
        for prompt in PROMPTS[:3]:
            check_prompt(llm, prompt, serve(engine, [(prompt, asked)])[0].logprobs, 4)
        no_bos = llm.tokenize(b"Once upon a time", add_bos=False)
        check_prompt(llm, no_bos, serve(engine, [(no_bos, asked)])[0].logprobs, 4)  # type: ignore[list-item]
        # the long prompt's cells, in a slot, and again in both: the scored one computes all of its prompt
        # (in several chunks) instead of reusing or copying them
        plain = GenerateParams(max_tokens=2, temperature=0)
        assert serve(engine, [(LONG_PROMPT, plain)])[0].reused_tokens == 0
        again, scored = serve(engine, [(LONG_PROMPT, plain), (LONG_PROMPT, asked)])
        assert again.reused_tokens == PROMPT_CHUNK and scored.reused_tokens == 0  # whole chunks only
        check_prompt(llm, LONG_PROMPT, scored.logprobs, 4)
        assert serve(engine, [(PROMPTS[0], GenerateParams(max_tokens=2, logprobs=1))])[0].logprobs.prompt == 0  # type: ignore[union-attr]
    finally:
        engine.close()
        llm.close()



def resident_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


@pytest.mark.real
@pytest.mark.timeout(300)
def test_scoring_a_prompt_on_a_large_vocabulary_does_not_keep_a_chunk_of_logits(real_model: RealModel) -> None:
    """llama.cpp keeps the largest logits buffer a context needed: scored in whole 512-token chunks, one echo
    request left Gemma's instance holding 512 rows of 262,144 logits (+0.9 GiB) for good."""
    engine = BatchEngine(EngineSettings(real_model.path, n_ctx=1024, parallel=1, threads=1, n_gpu_layers=0,
                                        repack=real_model.repack))
    prompt = "The history of the steam engine is long. " * 50
    try:
        serve(engine, [(prompt, GenerateParams(max_tokens=2, temperature=0))])
        before = resident_mib()
        (scored,) = serve(engine, [(prompt, GenerateParams(max_tokens=2, temperature=0, logprobs=1,
                                                          prompt_logprobs=True))])
        grown = resident_mib() - before
    finally:
        engine.close()
    assert scored.logprobs is not None and scored.logprobs.prompt == scored.prompt_tokens - 1 > 400
    whole_chunk_mib = PROMPT_CHUNK * 262_144 * 4 / 2**20  # a whole chunk's rows of Gemma's logits, as float32
    assert grown < whole_chunk_mib / 2, f"the instance grew by {grown:.0f} MiB"


@pytest.mark.timeout(120)
def test_the_zeromq_path_carries_the_prompt_s_streamed_and_not(tiny_server: ServerProcess,
                                                                 scoring: llama_cpp.Llama) -> None:
    with Client(tiny_server.address) as client:
        for prompt in PROMPTS[:2]:
            whole = client.generate(prompt, max_tokens=8, temperature=0, logprobs=TOP, prompt_logprobs=True)
            check_prompt(scoring, prompt, whole.logprobs, 8)
            stream = client.stream(prompt, max_tokens=8, temperature=0, logprobs=TOP, prompt_logprobs=True)
            assert "".join(stream) == whole.text
            assert stream.result is not None and stream.result.logprobs == whole.logprobs
        with pytest.raises(BadRequest, match="'prompt_logprobs' needs 'logprobs'"):
            client.generate("hi", prompt_logprobs=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_echo_equals_llama_cpp_python_s(gateway: GatewayThread, scoring: llama_cpp.Llama, stream: bool) -> None:
    oc = gateway.openai()
    prompt = PROMPTS[3]
    expected = scoring.create_completion(prompt, max_tokens=10, temperature=0, echo=True, logprobs=TOP)
    got = oc.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, echo=True,
                                logprobs=TOP, stream=stream)
    chunks = list(got) if stream else [got]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected["choices"][0]["text"] and text.startswith(prompt)
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    lp = {k: [v for p in parts for v in getattr(p, k)] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                                 "text_offset")}
    want = expected["choices"][0]["logprobs"]
    assert want is not None
    assert lp["tokens"] == want["tokens"] and lp["text_offset"] == want["text_offset"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=1e-4)
    # llama-cpp-python adds the token itself to its top entries; OpenAI's are the top N
    assert all(set(t) <= set(w) and len(t) == TOP for t, w in zip(lp["top_logprobs"][1:], want["top_logprobs"][1:],
                                                                  strict=True))
    plain = oc.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, echo=True)
    assert plain.choices[0].text == text and plain.choices[0].logprobs is None
    tokens = scoring.tokenize(prompt.encode(), add_bos=False)
    by_ids = oc.completions.create(model="tiny", prompt=tokens, max_tokens=10, temperature=0, echo=True)
    assert by_ids.choices[0].text.startswith(scoring.detokenize(tokens).decode())  # the tokens' text


@pytest.mark.timeout(60)
def test_echo_is_refused_where_it_has_no_meaning(gateway: GatewayThread) -> None:
    for path, body, words in [
        ("/v1/completions", {"prompt": "hi", "echo": "yes"}, "'echo' must be a boolean"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True},
         "unrecognized request argument(s) supplied: echo"),
    ]:
        answer = httpx.post(f"{gateway.url}{path}", json={"model": "tiny", **body}, timeout=10)
        assert answer.status_code == 400 and words in answer.json()["error"]["message"], body
