"""Embeddings: the engine and a real server (ZeroMQ, and HTTP with the official openai client) against
``Llama(embedding=True).embed`` (cosine >= 0.9999), one input and a batch of 32 in one decode; refusals."""

from __future__ import annotations

import base64
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import llama_cpp
import numpy as np
import pytest
import yaml
from conftest import ServerProcess
from gateway_thread import GatewayThread

from mpserve import Client
from mpserve.engine.embed import EmbeddingEngine
from mpserve.errors import BadRequest
from mpserve.models.builtin import builtin_model_path

TEXTS = [f"text {i}: the cat and the sea, {'again ' * (i % 5)}and all" for i in range(32)]


def cosines(got: list[list[float]] | np.ndarray, expected: list[list[float]]) -> list[float]:
    return [float(np.dot(g, e) / (np.linalg.norm(g) * np.linalg.norm(e))) for g, e in zip(got, expected, strict=True)]


@pytest.fixture(scope="module")
def reference() -> Iterator[llama_cpp.Llama]:
    llm = llama_cpp.Llama(str(builtin_model_path("tiny-embed")), embedding=True, n_ctx=512, n_threads=1,
                          verbose=False)
    yield llm
    llm.close()


@pytest.mark.timeout(60)
def test_the_engine_pools_like_llama_cpp_python_and_batches_in_one_decode(reference: llama_cpp.Llama) -> None:
    engine = EmbeddingEngine(str(builtin_model_path("tiny-embed")), 2048, 1, 1, 0)
    try:
        vectors, tokens = engine.embed(list(TEXTS))
        assert engine.decodes == 1 and vectors.shape == (32, 64)
        assert min(cosines(vectors, reference.embed(TEXTS))) >= 0.9999
        assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)  # normalised, as OpenAI's are
        assert tokens == sum(len(reference.tokenize(t.encode())) for t in TEXTS)
        by_ids, _ = engine.embed([reference.tokenize(TEXTS[0].encode())])
        assert cosines(by_ids, [reference.embed(TEXTS[0])]) >= [0.9999]
        engine.embed(["a b c " * 400] * 2)  # 2 × 1601 tokens: more than the context holds at once, two decodes
        assert engine.decodes == 4
        with pytest.raises(BadRequest, match="'input' 1 is 2802 tokens; the context holds 2048"):
            engine.embed(["hi", "a b c " * 700])
        with pytest.raises(BadRequest, match="this model is served with embedding: true"):
            engine.admit(0, "hi", None, lambda t, n: True)  # type: ignore[arg-type]
    finally:
        engine.close()
    with pytest.raises(ValueError, match="declares no pooling type"):
        EmbeddingEngine(str(builtin_model_path("tiny")), 512, 1, 1, 0)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "models.yaml"
        config.write_text(yaml.safe_dump({"models": [
            {"name": "emb", "path": "builtin:tiny-embed", "embedding": True},
            {"name": "tiny", "path": "builtin:tiny", "n_ctx": 512}]}))
        server = ServerProcess("--config", str(config)).wait_ready()
        yield server
        server.stop()


@pytest.fixture(scope="module")
def gateway(server: ServerProcess) -> Iterator[GatewayThread]:
    gw = GatewayThread(server_name=server.name)
    yield gw
    gw.stop()


@pytest.mark.timeout(120)
def test_the_zeromq_path_embeds_one_input_and_a_batch(server: ServerProcess, reference: llama_cpp.Llama) -> None:
    with Client(server.address) as client:
        one = client.embed(TEXTS[0], model="emb")
        assert len(one.vectors) == 1 and cosines(one.vectors, [reference.embed(TEXTS[0])]) >= [0.9999]
        batch = client.embed(TEXTS, model="emb")
        assert min(cosines(batch.vectors, reference.embed(TEXTS))) >= 0.9999
        ids = [reference.tokenize(t.encode()) for t in TEXTS[:3]]
        assert min(cosines(client.embed(ids, model="emb").vectors, batch.vectors[:3])) >= 0.9999
        assert client.embed(ids[0], model="emb").prompt_tokens == len(ids[0])
        with pytest.raises(BadRequest, match="model tiny is not an embedding model: serve one with embedding: true"):
            client.embed("hi", model="tiny")
        with pytest.raises(BadRequest, match="model emb is an embedding model \\(embedding: true"):
            client.generate("hi", model="emb")
        with pytest.raises(BadRequest, match="'input' must be texts or token arrays, not empty"):
            client.embed([], model="emb")


@pytest.mark.timeout(120)
def test_the_openai_client_gets_floats_and_base64(server: ServerProcess, gateway: GatewayThread,
                                                  reference: llama_cpp.Llama) -> None:
    oc = gateway.openai()
    got = oc.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    assert [d.index for d in got.data] == list(range(32)) and got.usage.prompt_tokens > 32
    assert min(cosines([d.embedding for d in got.data], reference.embed(TEXTS))) >= 0.9999
    default = oc.embeddings.create(model="emb", input="hello world")  # the client asks for base64 and decodes it
    assert cosines([default.data[0].embedding], [reference.embed("hello world")]) >= [0.9999]
    raw = httpx.post(f"{gateway.url}/v1/embeddings", json={"model": "emb", "input": [[1, 300, 301]],
                                                            "encoding_format": "base64"}, timeout=10).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert len(struct.unpack(f"<{len(packed) // 4}f", packed)) == 64 and raw["model"] == "emb"


@pytest.mark.timeout(60)
def test_bad_embedding_requests_are_refused_before_any_worker(server: ServerProcess, gateway: GatewayThread) -> None:
    with Client(server.address) as client:
        before = client.stats().counters.get("embed", 0)
    for body, words in [
        ({"model": "emb", "input": ""}, "'input' must be a non-empty string"),
        ({"model": "emb", "input": []}, "'input' must be a non-empty string"),
        ({"model": "emb", "input": [1, "a"]}, "'input' must be a non-empty string"),
        ({"model": "emb", "input": [-1]}, "'input' must be a list of token ids"),
        ({"model": "emb", "input": "x", "encoding_format": "hex"}, "'encoding_format' must be one of float, base64"),
        ({"model": "emb", "input": "x", "dimensions": 8}, "'dimensions' is not supported"),
        ({"model": "tiny", "input": "x"}, "model tiny is not an embedding model"),
        ({"model": "emb", "input": ["x"] * 2049}, "at most 2048 inputs"),
    ]:
        answer = httpx.post(f"{gateway.url}/v1/embeddings", json=body, timeout=10)
        assert answer.status_code == 400 and words in answer.json()["error"]["message"], body
    answer = httpx.post(f"{gateway.url}/v1/completions", json={"model": "emb", "prompt": "hi"}, timeout=10)
    assert answer.status_code == 400 and "embedding: true" in answer.json()["error"]["message"]
    with Client(server.address) as client:
        assert client.stats().counters.get("embed", 0) == before
