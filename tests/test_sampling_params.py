"""OpenAI's and llama-server's sampling parameters (presence and frequency penalties, logit bias, min-p,
typical-p, ignore_eos): the batched engine against ``create_completion`` in-process, then both serving paths
(ZeroMQ and HTTP) end to end, with their refusals."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import llama_cpp
import pytest
from conftest import ServerProcess
from engines import PROMPTS, make_engine, make_llama, serve
from gateway_thread import GatewayThread
from helpers import dealer, raw_request, received

from mpserve import Client
from mpserve.engine.batch import BatchEngine
from mpserve.errors import BadRequest
from mpserve.models.builtin import builtin_model_path
from mpserve.wire import protocol as wire
from mpserve.wire.protocol import GenerateParams

CASES: list[dict[str, Any]] = [
    {"temperature": 0, "presence_penalty": 1.5, "frequency_penalty": 0.8},
    {"temperature": 0, "logit_bias": {100: 5.0, 200: -3.0, 7: 100.0}, "repeat_penalty": 1.2},
    {"temperature": 0.9, "seed": 5, "presence_penalty": -0.5, "frequency_penalty": 1.0, "repeat_penalty": 1.1,
     "min_p": 0.1, "typical_p": 0.9, "top_k": 20},
    {"temperature": 0.7, "seed": 3, "logit_bias": {100: 5.0, 200: -3.0}, "min_p": 0.0, "top_p": 0.8},
]


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(builtin_model_path("tiny"))


@pytest.fixture(scope="module")
def llm(model_path: str) -> Iterator[llama_cpp.Llama]:
    llm = make_llama(model_path)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[BatchEngine]:
    engine = make_engine(model_path, 2)
    yield engine
    engine.close()


def params(max_tokens: int, **kw: Any) -> GenerateParams:
    return GenerateParams(max_tokens=max_tokens,
                          **{**kw, "logit_bias": wire.logit_bias_pairs(kw.get("logit_bias", {}))})


def tokens_spelling(llm: llama_cpp.Llama, char: str) -> list[int]:
    return [t for t in range(llm.n_vocab()) if char in llm.detokenize([t]).decode("utf-8", "ignore")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_engine_samples_what_create_completion_does_with_the_same_parameters(
        case: int, engine: BatchEngine, llm: llama_cpp.Llama) -> None:
    kw = CASES[case]
    plain = serve(engine, [(PROMPTS[1], params(30, temperature=kw["temperature"], seed=kw.get("seed")))])[0]
    for prompt in PROMPTS[:3]:
        expected = llm.create_completion(prompt, max_tokens=30, **kw)["choices"][0]["text"]
        assert serve(engine, [(prompt, params(30, **kw))])[0].text == expected, prompt
        if prompt == PROMPTS[1]:
            assert expected != plain.text  # the parameters changed what was sampled


@pytest.mark.timeout(60)
def test_a_logit_bias_of_minus_100_keeps_tokens_out_and_ignore_eos_keeps_going(
        engine: BatchEngine, llm: llama_cpp.Llama) -> None:
    greedy = serve(engine, [(PROMPTS[1], params(40, temperature=0))])[0].text
    char = next(c for c in greedy if c.isalpha())
    banned = {t: -100.0 for t in tokens_spelling(llm, char)}
    for sampled in ({"temperature": 0}, {"temperature": 1.5, "seed": 9}):
        text = serve(engine, [(PROMPTS[1], params(40, logit_bias=banned, **sampled))])[0].text
        assert char not in text and len(text) > 20
    eos = {llm.token_eos(): 1e4}  # the tiny model keeps EOS thousands below the rest; past the wire's range
    ended = serve(engine, [(PROMPTS[1], params(40, temperature=0, logit_bias=eos))])[0]
    assert (ended.finish_reason, ended.completion_tokens) == ("stop", 0)
    kept_on = serve(engine, [(PROMPTS[1], params(40, temperature=0, logit_bias=eos, ignore_eos=True))])[0]
    assert (kept_on.finish_reason, kept_on.completion_tokens) == ("length", 40)
    with pytest.raises(BadRequest, match="'logit_bias' has token 100000"):
        engine.admit(0, "hi", params(4, logit_bias={100000: 1.0}), lambda text, n: True)


# --- both serving paths -------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_both_paths_take_the_parameters_and_equal_create_completion(
        tiny_server: ServerProcess, gateway: GatewayThread, tiny_model_path: str, stream: bool) -> None:
    direct = llama_cpp.Llama(tiny_model_path, n_ctx=2048, n_threads=1, flash_attn=True, verbose=False)  # = auto
    oc = gateway.openai()
    try:
        with Client(tiny_server.address) as client:
            for kw in CASES:
                expected = direct.create_completion(PROMPTS[0], max_tokens=24, **kw)["choices"][0]["text"]
                if stream:
                    zmq_text = "".join(client.stream(PROMPTS[0], max_tokens=24, **kw))
                else:
                    zmq_text = client.generate(PROMPTS[0], max_tokens=24, **kw).text
                standard = {k: kw.pop(k) for k in ("presence_penalty", "frequency_penalty", "logit_bias",
                                                   "temperature", "seed", "top_p") if k in kw}
                # HTTP leaves out what OpenAI leaves out (its defaults differ from llama.cpp's): say them
                llama_defaults = {"temperature": 0.8, "top_p": 0.95}
                got = oc.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, stream=stream,
                                            extra_body={"top_k": 40, **kw}, **(llama_defaults | standard))
                http_text = "".join(c.choices[0].text for c in got) if stream else got.choices[0].text
                assert zmq_text == http_text == expected, standard | kw
                kw.update(standard)
    finally:
        direct.close()


BAD: list[tuple[dict[str, Any], str]] = [
    ({"presence_penalty": 2.5}, "'presence_penalty' must be between -2.0 and 2.0"),
    ({"frequency_penalty": -3}, "'frequency_penalty' must be between -2.0 and 2.0"),
    ({"logit_bias": {"5": 150}}, "'logit_bias' must be between -100.0 and 100.0"),
    ({"logit_bias": {"five": 1}}, "'logit_bias' keys must be token ids"),
    ({"logit_bias": [1, 2]}, "'logit_bias' must be a map"),
    ({"min_p": 1.5}, "'min_p' must be between 0.0 and 1.0"),
    ({"typical_p": -0.1}, "'typical_p' must be between 0.0 and 1.0"),
    ({"ignore_eos": 1}, "ignore_eos' must be a boolean"),
]


@pytest.mark.timeout(60)
def test_out_of_range_values_are_refused_on_both_paths_before_any_worker(
        tiny_server: ServerProcess, gateway: GatewayThread) -> None:
    served_before = sum(row.served for row in tiny_server.slots())
    with Client(tiny_server.address) as client:
        accepted_before = client.stats().counters.get("accepted", 0)
        for bad, words in BAD:
            with pytest.raises(BadRequest) as refused:
                client.generate("hi", max_tokens=4, **bad)
            assert words in refused.value.message
            for path, body in (("/v1/completions", {"prompt": "hi"}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
                answer = httpx.post(f"{gateway.url}{path}", json={"model": "tiny", **body, **bad}, timeout=10)
                assert answer.status_code == 400 and words in answer.json()["error"]["message"], (path, bad)
        # past the client's own checks: the broker refuses the same values with the same words (logit_bias: the
        # wire takes only the [token id, bias] pairs it declares, and refuses any other shape naming it)
        with dealer(tiny_server.address) as sock:
            for i, (bad, words) in enumerate(BAD):
                words = "'logit_bias'" if "logit_bias" in bad else words
                sock.send_multipart(raw_request({"id": f"bad{i}", "prompt": "hi", "params": bad}))
                err = received(sock)
                assert isinstance(err, wire.Error) and err.code == "bad_request" and words in err.message, bad
        assert client.stats().counters.get("accepted", 0) == accepted_before
    assert sum(row.served for row in tiny_server.slots()) == served_before
