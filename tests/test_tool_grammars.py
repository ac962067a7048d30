"""Forced calls in each family's own format (``Family.grammar``), written by the built-in tiny model under llama.cpp's
grammar sampler in this process and read back by the family's parser: random weights, so only the grammar makes
the reply a call; its name is one offered and its arguments hold to the tool's schema (with required properties),
for several seeds."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from mpserve.families import FAMILIES, read_forced

pytestmark = pytest.mark.timeout(120)

TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                                     "metric": {"type": "boolean"}},
                    "required": ["city", "days"], "additionalProperties": False},
    "get_time": {"type": "object", "properties": {}, "additionalProperties": False}}


@pytest.fixture(scope="module")
def llm(tiny_model_path: str) -> Iterator[Any]:
    import llama_cpp

    model = llama_cpp.Llama(tiny_model_path, n_ctx=512, verbose=False)
    yield model
    model.close()


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "json"])
def test_a_forced_call_is_written_in_the_family_s_format_and_read_back(llm: Any, family: str) -> None:
    import llama_cpp

    many = 1 if family == "gpt-oss" else 2
    for seed, offered in ((1, list(TOOLS.items())), (2, list(TOOLS.items())[:1]), (3, list(TOOLS.items())[:1])):
        grammar = llama_cpp.LlamaGrammar.from_string(FAMILIES[family].grammar(offered, many), verbose=False)
        text = llm.create_completion("Call a tool.", max_tokens=400, temperature=1.0, seed=seed, grammar=grammar,
                                     top_k=0, min_p=0.0)["choices"][0]["text"]
        found, cut = read_forced(FAMILIES[family], text, TOOLS)
        assert found and not cut and len(found) <= many, text
        assert {call.name for call in found} <= {name for name, _ in offered}
        for call in found:
            jsonschema.validate(json.loads(call.arguments), TOOLS[call.name])
