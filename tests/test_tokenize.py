"""Tokenize and detokenize through a real server (ZeroMQ and HTTP, llama-server's shapes), and prompts given as
token ids, against llama-cpp-python on the same tiny model."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import llama_cpp
import pytest
from conftest import ServerProcess
from gateway_thread import GatewayThread

from mpserve import Client
from mpserve.errors import BadRequest

TEXTS = ["Hello world", "The quick brown fox</s> jumps", "é ü 日本"]


@pytest.fixture(scope="module")
def direct(tiny_model_path: str) -> Iterator[llama_cpp.Llama]:
    llm = llama_cpp.Llama(tiny_model_path, n_ctx=2048, n_threads=1, flash_attn=True, verbose=False)  # = auto
    yield llm
    llm.close()


@pytest.mark.timeout(60)
def test_tokens_and_text_equal_llama_cpp_on_both_paths(tiny_server: ServerProcess, gateway: GatewayThread,
                                                       direct: llama_cpp.Llama) -> None:
    with Client(tiny_server.address) as client:
        for text in TEXTS:
            for add_special in (False, True):
                expected = direct.tokenize(text.encode(), add_bos=add_special, special=True)
                assert client.tokenize(text, add_special=add_special).tokens == expected
                http = httpx.post(f"{gateway.url}/tokenize", json={"content": text, "add_special": add_special},
                                  timeout=10)
                assert http.json() == {"tokens": expected}
            pieces = client.tokenize(text, with_pieces=True)
            assert pieces.pieces == [direct.detokenize([t], special=True) for t in pieces.tokens]
            http = httpx.post(f"{gateway.url}/tokenize", json={"content": text, "with_pieces": True}, timeout=10)
            assert [p["id"] for p in http.json()["tokens"]] == pieces.tokens
            assert all(p["piece"] == (b.decode() if b.decode(errors="ignore").encode() == b else list(b))
                       for p, b in zip(http.json()["tokens"], pieces.pieces, strict=True))
            tokens = direct.tokenize(text.encode(), add_bos=True, special=True)
            assert client.detokenize(tokens) == direct.detokenize(tokens, special=True).decode()
            http = httpx.post(f"{gateway.url}/detokenize", json={"tokens": tokens}, timeout=10)
            assert http.json() == {"content": direct.detokenize(tokens, special=True).decode()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_prompt_of_token_ids_is_taken_as_it_is(tiny_server: ServerProcess, gateway: GatewayThread,
                                                 direct: llama_cpp.Llama, stream: bool) -> None:
    oc = gateway.openai()
    with Client(tiny_server.address) as client:
        for text in TEXTS:
            tokens = direct.tokenize(text.encode(), add_bos=True, special=True)
            expected = direct.create_completion(tokens, max_tokens=16, temperature=0)["choices"][0]["text"]
            assert expected == direct.create_completion(text, max_tokens=16, temperature=0)["choices"][0]["text"]
            result = client.generate(tokens, max_tokens=16, temperature=0)
            assert result.text == expected and result.usage.prompt_tokens == len(tokens)
            got = oc.completions.create(model="tiny", prompt=tokens, max_tokens=16, temperature=0, stream=stream)
            assert ("".join(c.choices[0].text for c in got) if stream else got.choices[0].text) == expected


@pytest.mark.timeout(60)
def test_bad_tokens_and_bodies_are_refused_naming_the_parameter(tiny_server: ServerProcess,
                                                                gateway: GatewayThread) -> None:
    with Client(tiny_server.address) as client:
        with pytest.raises(BadRequest, match="'tokens' has token 99999"):
            client.detokenize([1, 99999])
        with pytest.raises(BadRequest, match="'prompt' has token 99999"):
            client.generate([1, 99999], max_tokens=2)
    for path, body, words in [
        ("/tokenize", {"content": 5}, "'content' is required"),
        ("/tokenize", {"content": "x", "with_pieces": "yes"}, "'with_pieces' must be a boolean"),
        ("/tokenize", {"content": "x", "extra": 1}, "unrecognized request argument(s) supplied: extra"),
        ("/detokenize", {"tokens": ["a"]}, "'tokens' must be a list of token ids"),
        ("/detokenize", {"tokens": [-1]}, "'tokens' must be a list of token ids"),
        ("/detokenize", {"tokens": [99999]}, "'tokens' has token 99999"),
        ("/tokenize", {"content": "x", "model": "nope"}, "served models: tiny"),
        ("/v1/completions", {"prompt": [1, "a"]}, "'prompt' must be one string or one list of token ids"),
        ("/v1/completions", {"prompt": [1, 99999]}, "'prompt' has token 99999"),
    ]:
        answer = httpx.post(f"{gateway.url}{path}", json=body, timeout=10)
        assert answer.status_code in (400, 404) and words in answer.json()["error"]["message"], (path, body)
