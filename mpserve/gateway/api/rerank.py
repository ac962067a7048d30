"""``POST /v1/rerank`` (and llama-server's ``/rerank``): a reranker's scores of documents against a query, in
the shape llama-server, Jina and Cohere answer with. No I/O here.

    {"query": str, "documents": [str | {"text": str}, ...], "model", "top_n", "return_documents"}
        ──parse──▶ Client.rerank(query, documents) ──▶ a model served with embedding: true, pooling: rank
    scores ──answer──▶ {"object": "list", "model", "results": [{"index", "relevance_score", "document"?}, ...]
                        most relevant first, the top_n of them, "usage": {"prompt_tokens", "total_tokens"}}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mpserve.client import Reranked
from mpserve.errors import BadRequest
from mpserve.wire import protocol as wire

from . import openai as oai

FIELDS = frozenset({"model", "query", "documents", "top_n", "return_documents", "user"})


@dataclass(frozen=True)
class RerankCall:
    model: str | None
    query: str
    documents: list[str]
    top_n: int
    return_documents: bool


def parse(body: Any) -> RerankCall:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    given = oai.given_fields(body, FIELDS, {})
    model, query, documents = given.get("model"), given.get("query"), given.get("documents")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    if not isinstance(query, str) or not query:
        raise BadRequest("'query' is required: a non-empty string")
    if not isinstance(documents, list) or not documents or len(documents) > wire.MAX_EMBED_INPUTS:
        raise BadRequest(f"'documents' is required: a list of 1 to {wire.MAX_EMBED_INPUTS} texts")
    given_texts = [d.get("text") if isinstance(d, dict) else d for d in documents]
    texts = [t for t in given_texts if isinstance(t, str) and t]
    if len(texts) < len(given_texts):
        bad = next(i for i, t in enumerate(given_texts) if not isinstance(t, str) or not t)
        raise BadRequest(f"documents[{bad}] must be a non-empty string (or {{\"text\": string}})")
    top_n = given.get("top_n", len(texts))
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1:
        raise BadRequest("'top_n' must be an integer of at least 1")
    return_documents = given.get("return_documents", False)
    if not isinstance(return_documents, bool):
        raise BadRequest("'return_documents' must be a boolean")
    return RerankCall(model, query, texts, top_n, return_documents)


def answer(call: RerankCall, result: Reranked, model: str) -> dict[str, Any]:
    order = sorted(range(len(result.scores)), key=lambda i: -result.scores[i])[:call.top_n]
    return {"object": "list", "model": model, "results": [
        {"index": i, "relevance_score": result.scores[i],
         **({"document": {"text": call.documents[i]}} if call.return_documents else {})} for i in order],
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}}
