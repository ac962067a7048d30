"""Log-probabilities: the engine's against a direct computation from ``Llama(logits_all=True)``'s scores, and
through a real server (ZeroMQ; HTTP in OpenAI's shapes), streamed and not."""

from __future__ import annotations

import httpx
import llama_cpp
import numpy as np
import pytest
from conftest import ServerProcess
from engines import PROMPTS, make_engine, scoring_llama, serve
from gateway_thread import GatewayThread

from mpserve import Client
from mpserve.errors import BadRequest
from mpserve.models.builtin import builtin_model_path
from mpserve.wire import protocol as wire
from mpserve.wire.protocol import GenerateParams

TOP = 5
SAMPLING = [{"temperature": 0}, {"temperature": 0.9, "seed": 4}, {"temperature": 1.2, "seed": 11, "top_k": 5}]


def check(llm: llama_cpp.Llama, prompt: str, max_tokens: int, sampling: dict[str, object],
          text: str, lp: wire.Logprobs | None) -> None:
    """``lp`` equals the log-softmax of llama.cpp's logits for the same completion, within 1e-4."""
    expected = llm.create_completion(prompt, max_tokens=max_tokens, **sampling)  # type: ignore[arg-type]
    assert text == expected["choices"][0]["text"]
    assert lp is not None and lp.top == TOP
    n_prompt = expected["usage"]["prompt_tokens"]
    entries = lp.entries()
    assert len(entries) == max_tokens
    for i, (token, piece, logprob, top) in enumerate(entries):
        row = llm.scores[n_prompt - 1 + i].astype(np.float64)
        log_softmax = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
        if n_prompt + i < llm.n_tokens:  # the last sampled token was never evaluated there
            assert token == llm._input_ids[n_prompt + i]
        assert piece == llm.detokenize([token])
        assert abs(log_softmax[token] - logprob) < 1e-4
        assert [t for t, _, _ in top] == list(np.argsort(-log_softmax, kind="stable")[:TOP])
        assert all(abs(log_softmax[t] - v) < 1e-4 for t, _, v in top)
        assert [v for _, _, v in top] == sorted((v for _, _, v in top), reverse=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "sampled", "sampled-top-k"])
def test_the_engine_reports_the_log_softmax_of_the_raw_logits(sampling: dict[str, object]) -> None:
    path = str(builtin_model_path("tiny"))
    llm = scoring_llama(path, flash_attn=False)
    engine = make_engine(path, 2)
    try:
        for prompt in PROMPTS[:3]:
            c = serve(engine, [(prompt, GenerateParams(max_tokens=12, logprobs=TOP, **sampling))])[0]  # type: ignore[arg-type]
            check(llm, prompt, 12, sampling, c.text, c.logprobs)
        assert serve(engine, [(PROMPTS[0], GenerateParams(max_tokens=4))])[0].logprobs is None
    finally:
        engine.close()
        llm.close()


@pytest.mark.timeout(120)
def test_the_zeromq_path_carries_them_streamed_and_not(tiny_server: ServerProcess, scoring: llama_cpp.Llama) -> None:
    with Client(tiny_server.address) as client:
        for sampling in SAMPLING[:2]:
            for prompt in PROMPTS[:2]:
                whole = client.generate(prompt, max_tokens=20, logprobs=TOP, **sampling)
                check(scoring, prompt, 20, sampling, whole.text, whole.logprobs)
                stream = client.stream(prompt, max_tokens=20, logprobs=TOP, **sampling)
                text = "".join(stream)
                assert stream.result is not None and stream.result.logprobs == whole.logprobs
                assert text == whole.text
        with pytest.raises(BadRequest, match="'logprobs' must be between 0 and 20"):
            client.generate("hi", logprobs=21)
        assert client.generate("hi", max_tokens=3, logprobs=0).logprobs.entries()[0][3] == []  # type: ignore[union-attr]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_openai_client_gets_them_in_openai_s_shapes(tiny_server: ServerProcess, gateway: GatewayThread,
                                                        stream: bool) -> None:
    oc = gateway.openai()
    prompt = PROMPTS[1]
    with Client(tiny_server.address) as client:
        whole = client.generate(prompt, max_tokens=16, temperature=0, logprobs=TOP)
        assert whole.logprobs is not None
        entries = whole.logprobs.entries()
        chat_prompt = client.generate("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", max_tokens=16,
                                      temperature=0, logprobs=3, stop=["<|im_end|>"])
    got = oc.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, logprobs=TOP, stream=stream)
    parts = [c.choices[0].logprobs for c in got if c.choices and c.choices[0].logprobs] if stream else [
        got.choices[0].logprobs]
    lp = {k: [v for p in parts for v in getattr(p, k)] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                                 "text_offset")}
    assert lp["tokens"] == [piece.decode() for _, piece, _, _ in entries]
    # equal within 1e-4: another instance, or cells reused from another prompt, may round differently
    assert lp["token_logprobs"] == pytest.approx([logprob for _, _, logprob, _ in entries], abs=1e-4)
    assert [list(t) for t in lp["top_logprobs"]] == [[t.decode() for _, t, _ in top] for _, _, _, top in entries]
    assert [list(t.values()) for t in lp["top_logprobs"]] == [
        pytest.approx([v for _, _, v in top], abs=1e-4) for _, _, _, top in entries]
    assert lp["text_offset"][0] == len(prompt)
    assert lp["text_offset"][1:] == [len(prompt) + len("".join(lp["tokens"][:i])) for i in range(1, 16)]
    chat = oc.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=16,
                                      temperature=0, logprobs=True, top_logprobs=3, stream=stream)
    content = [e for c in chat if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []
               ] if stream else chat.choices[0].logprobs.content
    assert chat_prompt.logprobs is not None
    expected = chat_prompt.logprobs.entries()
    assert [(e.token, bytes(e.bytes or [])) for e in content] == [(p.decode(), p) for _, p, _, _ in expected]
    assert [e.logprob for e in content] == pytest.approx([logprob for _, _, logprob, _ in expected], abs=1e-4)
    assert [[t.token for t in e.top_logprobs] for e in content] == [[t.decode() for _, t, _ in top]
                                                                   for _, _, _, top in expected]
    assert [[t.logprob for t in e.top_logprobs] for e in content] == [
        pytest.approx([v for _, _, v in top], abs=1e-4) for _, _, _, top in expected]


@pytest.mark.timeout(60)
def test_bad_logprobs_requests_are_refused_naming_the_parameter(gateway: GatewayThread) -> None:
    messages = [{"role": "user", "content": "hi"}]
    for path, body, words in [
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "'logprobs' must be between 0 and 20"),
        ("/v1/chat/completions", {"messages": messages, "logprobs": True, "top_logprobs": 50},
         "'logprobs' must be between 0 and 20"),
        ("/v1/chat/completions", {"messages": messages, "top_logprobs": 2}, "'top_logprobs' needs 'logprobs': true"),
        ("/v1/chat/completions", {"messages": messages, "logprobs": 3}, "'logprobs' must be a boolean"),
    ]:
        answer = httpx.post(f"{gateway.url}{path}", json={"model": "tiny", **body}, timeout=10)
        assert answer.status_code == 400 and words in answer.json()["error"]["message"], body
