"""The OpenAPI document lists, for each route with a JSON body, exactly the fields that route's parser takes: the
fields each parser declares (and checks bodies against) are the document's, and every field the document lists is
taken by the parser, not refused as unrecognized (issue 58: chat's tools, response_format, priority and lora were
taken and not listed). A field added to a parser without its entry in the document fails here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest

from mpserve.errors import BadRequest
from mpserve.gateway.api import dialect, embeddings, extensions, messages, rerank, responses, schema, tokens
from mpserve.gateway.api import openai as oai
from mpserve.gateway.ops import admin

pytestmark = pytest.mark.timeout(30)

GENERATION = dialect.PIPELINE_FIELDS  # taken by the pipeline before the dialect reads the body
PARSERS: dict[str, tuple[frozenset[str], dict[str, Any], Callable[[dict[str, Any]], object]]] = {
    # the schema: (the fields its parser takes, a smallest body it takes, the parser as the route runs it)
    "CompletionRequest": (oai.FIELDS["completion"] | frozenset(oai.UNSUPPORTED) | extensions.FIELDS | GENERATION,
                          {"prompt": "hi"}, lambda body: oai.parse("completion", body)),
    "ChatRequest": (oai.FIELDS["chat"] | frozenset(oai.UNSUPPORTED) | extensions.FIELDS | GENERATION,
                    {"messages": [{"role": "user", "content": "hi"}]}, lambda body: oai.parse("chat", body)),
    "ResponseRequest": (responses.FIELDS | frozenset(responses.UNSUPPORTED) | GENERATION, {"input": "hi"},
                        lambda body: responses.Responses(cast(Any, None), cast(Any, None)).parse(body, "owner")),
    "MessageRequest": (messages.FIELDS | frozenset(messages.UNSUPPORTED) | GENERATION,
                       {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
                       lambda body: messages.Messages.parse(body, "owner")),
    "EmbeddingRequest": (embeddings.FIELDS, {"input": "hi"}, embeddings.parse),
    "RerankRequest": (rerank.FIELDS, {"query": "q", "documents": ["d"]}, rerank.parse),
    "TokenizeRequest": (tokens.TOKENIZE_FIELDS, {"content": "hi"}, tokens.parse_tokenize),
    "DetokenizeRequest": (tokens.DETOKENIZE_FIELDS, {"tokens": [1]}, tokens.parse_detokenize),
}
BODIES = {"AddModelRequest": admin.BODIES["add"][0], "ScaleRequest": admin.BODIES["scale"][0],
          "LoadAdapterRequest": admin.ADAPTER_FIELDS}


def listed(name: str) -> set[str]:
    shape = schema.document("test")["components"]["schemas"][name]
    assert shape["additionalProperties"] is False, f"{name} must refuse what it does not list"
    return set(shape["properties"])


def taken(parse: Callable[[dict[str, Any]], object], body: dict[str, Any]) -> str:
    """What the route answers ``body`` with, as far as its fields go: "" when it takes them, else the refusal."""
    body = dict(body)
    if parse in (PARSERS[n][2] for n in ("CompletionRequest", "ChatRequest", "ResponseRequest", "MessageRequest")):
        dialect.take_cache_salt(body), dialect.take_priority(body)
    try:
        parse(body)
    except BadRequest as exc:
        return exc.message
    return ""


@pytest.mark.parametrize("name", [*PARSERS, *BODIES])
def test_the_document_lists_the_fields_the_parser_takes(name: str) -> None:
    fields = PARSERS[name][0] if name in PARSERS else BODIES[name]
    assert listed(name) - fields == set(), "listed, not taken"
    assert fields - listed(name) == set(), "taken, not listed"


@pytest.mark.parametrize("name", list(PARSERS))
def test_every_field_listed_is_taken_at_null_and_another_refused(name: str) -> None:
    _, body, parse = PARSERS[name]
    assert taken(parse, body) == ""
    for field in sorted(listed(name) - set(body)):
        refusal = taken(parse, {**body, field: None})
        assert "unrecognized" not in refusal and refusal == "", f"{field}: {refusal}"
    assert "unrecognized request argument(s) supplied: not_a_field" in taken(parse, {**body, "not_a_field": 1})


def test_chat_lists_what_issue_58_found_missing() -> None:
    assert {"tools", "tool_choice", "response_format", "priority", "lora", "cache_salt"} <= listed("ChatRequest")
