"""Reranking: the built-in random-weight reranker (``builtin:tiny-rerank``, llama.cpp's rank pooling) scores
each query and document pair as llama.cpp's own rank pooling does on the same tokens, decoded alone in a fresh
context; through a real server, over ZeroMQ (``Client.rerank``) and HTTP (``/v1/rerank``, ``/rerank``), in
llama-server's shape; refusals. A random-weight reranker's order means nothing, so whether relevant documents
rank first needs real weights, which no test here has."""

from __future__ import annotations

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

QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital of France.", "The cat sat on the mat.", "Bananas are yellow.",
             "France is a country in Europe, and its capital is Paris. " * 3]
BATCH_ATOL = 5e-4  # scores in (0, 1): several pairs in one decode round differently from one alone


class RankReference:
    """llama.cpp's rank pooling through llama_cpp's own calls: one pair at a time, a fresh sequence each."""

    def __init__(self) -> None:
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(builtin_model_path("tiny-rerank")).encode(), params)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.embeddings, ctx_params.pooling_type = True, llama_cpp.LLAMA_POOLING_TYPE_RANK
        ctx_params.n_ctx = ctx_params.n_batch = ctx_params.n_ubatch = 512
        ctx_params.n_threads = ctx_params.n_threads_batch = 1
        self.ctx = llama_cpp.llama_init_from_model(self.model, ctx_params)

    def tokens(self, text: str) -> list[int]:
        out = (llama_cpp.llama_token * 512)()
        n = llama_cpp.llama_tokenize(self.vocab, text.encode(), len(text.encode()), out, 512, False, False)
        return list(out[:n])

    def score(self, query: str, document: str) -> float:
        bos, eos = llama_cpp.llama_vocab_bos(self.vocab), llama_cpp.llama_vocab_eos(self.vocab)
        pair = [bos, *self.tokens(query), eos, *self.tokens(document), eos]  # the vocabulary has no SEP
        batch = llama_cpp.llama_batch_init(len(pair), 0, 1)
        try:
            for i, token in enumerate(pair):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, 1
                batch.seq_id[i][0] = 0
            batch.n_tokens = len(pair)
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
            assert llama_cpp.llama_decode(self.ctx, batch) == 0
            return float(llama_cpp.llama_get_embeddings_seq(self.ctx, 0)[0])
        finally:
            llama_cpp.llama_batch_free(batch)

    def close(self) -> None:
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


@pytest.fixture(scope="module")
def reference() -> Iterator[RankReference]:
    ref = RankReference()
    yield ref
    ref.close()


@pytest.mark.timeout(60)
def test_the_engine_scores_as_llama_cpps_rank_pooling(reference: RankReference) -> None:
    engine = EmbeddingEngine(str(builtin_model_path("tiny-rerank")), 2048, 1, 1, 0)
    try:
        assert engine.reranker and engine.dim == 2  # the rank head's two labels
        expected = [reference.score(QUERY, d) for d in DOCUMENTS]
        assert [float(engine.rank(QUERY, [d])[0][0]) for d in DOCUMENTS] == expected  # one pair a decode: equal
        scores, tokens = engine.rank(QUERY, DOCUMENTS)
        # all pairs in one decode: equal up to the rounding of a batch of another shape
        assert engine.decodes == len(DOCUMENTS) + 1 and np.allclose(scores, expected, atol=BATCH_ATOL)
        assert all(0 < s < 1 for s in scores) and len(set(scores.tolist())) == len(DOCUMENTS)
        assert tokens == sum(len(reference.tokens(QUERY)) + len(reference.tokens(d)) + 3 for d in DOCUMENTS)
        with pytest.raises(BadRequest, match="this model is a reranker"):
            engine.embed(["hi"])
    finally:
        engine.close()
    embedder = EmbeddingEngine(str(builtin_model_path("tiny-embed")), 512, 1, 1, 0)
    try:
        with pytest.raises(BadRequest, match="this model is not a reranker: serve one with pooling: rank"):
            embedder.rank(QUERY, DOCUMENTS)
    finally:
        embedder.close()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "models.yaml"
        config.write_text(yaml.safe_dump({"models": [
            {"name": "rr", "path": "builtin:tiny-rerank", "embedding": True, "pooling": "rank"},
            {"name": "emb", "path": "builtin:tiny-embed", "embedding": True}]}))
        server = ServerProcess("--config", str(config)).wait_ready()
        yield server
        server.stop()
        assert not server.tracebacks()


@pytest.fixture(scope="module")
def gateway(server: ServerProcess) -> Iterator[GatewayThread]:
    gw = GatewayThread(server_name=server.name)
    yield gw
    gw.stop()


@pytest.mark.timeout(120)
def test_zeromq_and_http_rerank_in_llama_servers_shape(server: ServerProcess, gateway: GatewayThread,
                                                       reference: RankReference) -> None:
    expected = [reference.score(QUERY, d) for d in DOCUMENTS]
    with Client(server.address) as client:
        got = client.rerank(QUERY, DOCUMENTS, model="rr")
        assert np.allclose(got.scores, expected, atol=BATCH_ATOL)
        with pytest.raises(BadRequest, match="this model is not a reranker"):
            client.rerank(QUERY, DOCUMENTS, model="emb")
        with pytest.raises(BadRequest, match="this model is a reranker"):
            client.embed("hi", model="rr")
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -got.scores[i])
    for path in ("/v1/rerank", "/rerank"):
        r = httpx.post(gateway.url + path, timeout=30, json={
            "model": "rr", "query": QUERY, "documents": [DOCUMENTS[0], {"text": DOCUMENTS[1]}, *DOCUMENTS[2:]],
            "top_n": 3, "return_documents": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["model"] == "rr"
        assert body["usage"]["prompt_tokens"] == got.prompt_tokens
        assert [x["index"] for x in body["results"]] == order[:3]
        assert [x["relevance_score"] for x in body["results"]] == [got.scores[i] for i in order[:3]]
        assert [x["document"]["text"] for x in body["results"]] == [DOCUMENTS[i] for i in order[:3]]
    plain = httpx.post(gateway.url + "/v1/rerank", json={"model": "rr", "query": QUERY, "documents": DOCUMENTS},
                       timeout=30).json()
    assert len(plain["results"]) == len(DOCUMENTS) and "document" not in plain["results"][0]
    for bad, says in [({"documents": DOCUMENTS}, "'query' is required"), ({"query": QUERY}, "'documents'"),
                      ({"query": QUERY, "documents": ["x", ""]}, "documents[1]"),
                      ({"query": QUERY, "documents": ["x"], "top_n": 0}, "'top_n'"),
                      ({"query": QUERY, "documents": ["x"], "rank_fields": ["a"]}, "unrecognized"),
                      ({"model": "emb", "query": QUERY, "documents": ["x"]}, "not a reranker")]:
        r = httpx.post(gateway.url + "/v1/rerank", json={"model": "rr", **bad}, timeout=30)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
