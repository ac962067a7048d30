"""Structured output on the engine and the ZeroMQ path: every constrained completion parses and validates
(jsonschema) against its schema, constrained and unconstrained sequences share a batch without changing
each other, and malformed grammars and schemas are bad_request while the worker serves on."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from conftest import ServerProcess
from engines import finish
from structured_cases import MAX_TOKENS, PROMPT, SCHEMAS

from mpserve import AsyncClient, Client
from mpserve.engine.batch import BatchEngine
from mpserve.engine.settings import EngineSettings
from mpserve.errors import BadRequest, ErrorCode, GrammarTooComplex
from mpserve.models.builtin import builtin_model_path
from mpserve.structured import canonical_json, schema_grammar
from mpserve.wire.protocol import GenerateParams
from mpserve.wire.slots import SlotState

NEIGHBOUR_PROMPTS = ["The quick brown fox", "Once upon a time in the land of"]
# alternatives that begin alike: llama.cpp would keep a parse stack for each at every step
AMBIGUOUS_GRAMMAR = "root ::= " + " | ".join(f'"the same beginning, then {i}"' for i in range(340))
AMBIGUOUS_PATTERN = {"type": "string", "pattern": "^(" + "|".join(f"ab{i}" for i in range(150)) + ")$"}

# GBNF that llama.cpp refuses (found at admission) and text refused before it (size, nesting, no root)
BAD_GRAMMARS = [
    'root ::= foo', 'root ::= "a" | ( "b"', 'root ::= [a-', 'root ::= "unterminated', 'root ::= root "a"',
    'root ::= "a" {2,1}', 'root ::= "\\q"', 'root ::= ( "a" ))', 'root ::= "a"\nroot2 ::=: "b"', 'root := "a"',
    "x ::= \"a\"", "", "   ", "root ::= " + "(" * 80 + '"a"' + ")" * 80, 'root ::= "' + "a" * 70000 + '"',
]
BAD_SCHEMAS: list[Any] = [
    {"type": "string", "oneOf": [{}]}, {"allOf": [{"type": "object"}]}, {"not": {"type": "null"}},
    {"type": "array", "uniqueItems": True}, {"type": "integer", "multipleOf": 2}, {"type": "strng"},
    {"$ref": "#/$defs/nope"}, {"$ref": "other.json#/x"}, {"type": "string", "format": "email"},
    {"type": "string", "pattern": "(?<=x)y"}, {"type": "string", "pattern": "(["}, {"enum": []},
    {"type": "integer", "minimum": 3, "maximum": 2}, {"type": "object", "minProperties": 1}, [1, 2], "not json {",
]


def complete(engine: BatchEngine, slot: int, prompt: str, params: GenerateParams,
             pieces: list[str] | None = None) -> None:
    engine.admit(slot, prompt, params, lambda text, n: pieces.append(text) is None if pieces is not None else True)


def constrained(schema: Any, temperature: float = 0.0, seed: int = 0) -> GenerateParams:
    return GenerateParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed, json_schema=canonical_json(schema))


def assert_valid(text: str, schema: Any) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def engine() -> Iterator[BatchEngine]:
    engine = BatchEngine(EngineSettings(str(builtin_model_path("tiny")), n_ctx=1024, parallel=4, threads=1,
                                        n_gpu_layers=0, reuse="exact"))  # neighbours are compared with their text alone
    yield engine
    engine.close()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_every_schema_yields_json_that_validates(engine: BatchEngine, temperature: float) -> None:
    assert len(SCHEMAS) >= 20
    for i, schema in enumerate(SCHEMAS):
        pieces: list[str] = []
        complete(engine, 0, PROMPT, constrained(schema, temperature, seed=i), pieces)
        done = finish(engine)[0]
        assert done.finish_reason == "stop", (schema, done.text)
        assert "".join(pieces) == done.text
        assert_valid(done.text, schema)


def test_constrained_and_unconstrained_sequences_share_a_batch(engine: BatchEngine) -> None:
    greedy = GenerateParams(max_tokens=48, temperature=0.0)
    alone = []
    for prompt in NEIGHBOUR_PROMPTS:
        complete(engine, 0, prompt, greedy)
        alone.append(finish(engine)[0].text)
    for first in range(0, len(SCHEMAS), 2):
        pair = SCHEMAS[first:first + 2]
        for slot, schema in enumerate(pair):
            complete(engine, slot, PROMPT, constrained(schema))
        for slot, prompt in enumerate(NEIGHBOUR_PROMPTS, start=2):
            complete(engine, slot, prompt, greedy)
        done = finish(engine)
        assert [done[2].text, done[3].text] == alone
        for slot, schema in enumerate(pair):
            assert_valid(done[slot].text, schema)


def test_a_constrained_completion_cut_by_length_is_returned_as_is(engine: BatchEngine) -> None:
    complete(engine, 1, PROMPT, GenerateParams(max_tokens=6, temperature=0.0, json_schema='{"type":"string"}'))
    done = finish(engine)[1]
    assert done.finish_reason == "length" and done.completion_tokens == 6
    assert done.text.startswith('"')
    with pytest.raises(ValueError):
        json.loads(done.text)


def test_a_grammar_constrains_and_is_parsed_once(engine: BatchEngine) -> None:
    grammar = 'root ::= ("yes" | "no") " " [0-9] [0-9]'
    texts = []
    cached = len(engine._grammars)
    for _ in range(3):
        complete(engine, 0, PROMPT, GenerateParams(max_tokens=20, temperature=0.0, grammar=grammar))
        done = finish(engine)[0]
        assert done.finish_reason == "stop"
        texts.append(done.text)
    assert len(set(texts)) == 1 and texts[0].split(" ")[0] in ("yes", "no") and texts[0][-2:].isdigit()
    assert len(engine._grammars) == cached + 1  # parsed once, cloned for each sequence


def test_llama_cpp_refusing_a_grammar_is_a_bad_request_at_admission(engine: BatchEngine) -> None:
    refused = 0
    for grammar in BAD_GRAMMARS:
        with pytest.raises(BadRequest):
            params = GenerateParams(max_tokens=8, grammar=grammar)
            params.validate()
            refused += 1  # passed the checks without llama.cpp: llama.cpp refuses it
            complete(engine, 0, PROMPT, params)
    assert refused >= 8
    assert engine.free_slots() == [0, 1, 2, 3]
    complete(engine, 0, PROMPT, GenerateParams(max_tokens=4, temperature=0.0))
    assert finish(engine)[0].completion_tokens == 4


def test_a_grammar_of_too_many_alternatives_alike_is_refused_at_admission_by_its_ambiguity(
        engine: BatchEngine) -> None:
    for params in (GenerateParams(max_tokens=8, grammar=AMBIGUOUS_GRAMMAR),
                   GenerateParams(max_tokens=8, json_schema=canonical_json(AMBIGUOUS_PATTERN))):
        params.validate()  # the cheap checks let it through: its ambiguity is measured where it is admitted
        with pytest.raises(GrammarTooComplex, match=r"more than 64 alternatives that begin alike"):
            complete(engine, 0, PROMPT, params)
    assert engine.free_slots() == [0, 1, 2, 3]
    fewer = "root ::= " + " | ".join(f'"the same beginning, then {i}"' for i in range(50))
    complete(engine, 0, PROMPT, GenerateParams(max_tokens=40, temperature=0.0, grammar=fewer))
    assert finish(engine)[0].text.startswith("the same beginning, then ")


def test_a_grammar_step_past_its_budget_ends_its_request_by_name_and_its_neighbour_completes() -> None:
    """A budget no grammar step can keep (none): the constrained sequence ends at its first step with
    grammar_too_complex; the unconstrained one in the same batch gives the text it gives alone."""
    engine = BatchEngine(EngineSettings(str(builtin_model_path("tiny")), n_ctx=1024, parallel=2, threads=1,
                                        n_gpu_layers=0, reuse="exact", grammar_step_s=0.0))
    try:
        greedy = GenerateParams(max_tokens=24, temperature=0.0)
        complete(engine, 1, NEIGHBOUR_PROMPTS[0], greedy)
        alone = finish(engine)[1].text
        complete(engine, 0, PROMPT, GenerateParams(max_tokens=24, temperature=0.0, grammar='root ::= "ok" [0-9]+'))
        complete(engine, 1, NEIGHBOUR_PROMPTS[0], greedy)
        done = finish(engine)
        assert done[0].finish_reason == "error" and done[0].completion_tokens == 0, done[0]
        assert done[0].error is not None and done[0].error.code is ErrorCode.GRAMMAR_TOO_COMPLEX
        assert "past its budget" in done[0].error.message
        assert done[1].finish_reason == "length" and done[1].text == alone
        assert engine.free_slots() == [0, 1]
    finally:
        engine.close()


# --- the ZeroMQ path ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    server = ServerProcess("--instances", "1", "--parallel", "4", "--reuse", "exact").wait_ready()
    yield server
    server.stop()


def test_the_client_constrains_streamed_and_not(server: ServerProcess) -> None:
    with Client(server.address, timeout=120) as client:
        for schema in SCHEMAS:
            whole = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, json_schema=schema)
            assert whole.finish_reason == "stop"
            assert_valid(whole.text, schema)
            stream = client.stream(PROMPT, max_tokens=MAX_TOKENS, temperature=0, json_schema=json.dumps(schema))
            assert "".join(stream) == whole.text
        grammar = client.generate(PROMPT, max_tokens=8, temperature=0, grammar='root ::= "ok" [0-9]')
        assert grammar.text[:2] == "ok" and grammar.finish_reason == "stop"


def test_parallel_constrained_requests_leave_their_neighbours_unchanged(server: ServerProcess) -> None:
    async def main() -> None:
        async with AsyncClient(server.address, timeout=120) as client:
            alone = [(await client.generate(p, max_tokens=48, temperature=0)).text for p in NEIGHBOUR_PROMPTS]
            for first in range(0, 8, 2):
                pair = SCHEMAS[first:first + 2]
                results = await asyncio.gather(
                    *(client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, json_schema=s) for s in pair),
                    *(client.generate(p, max_tokens=48, temperature=0) for p in NEIGHBOUR_PROMPTS))
                assert [r.text for r in results[2:]] == alone
                for result, schema in zip(results[:2], pair, strict=True):
                    assert_valid(result.text, schema)

    asyncio.run(main())


def test_malformed_grammars_and_schemas_are_bad_requests_and_the_worker_serves_on(server: ServerProcess) -> None:
    assert len(BAD_GRAMMARS) + len(BAD_SCHEMAS) >= 30
    pids = {row.pid for row in server.slots() if row.state is not SlotState.EMPTY}
    with Client(server.address, timeout=60) as client:
        for grammar in BAD_GRAMMARS:
            with pytest.raises(BadRequest):
                client.generate(PROMPT, max_tokens=8, grammar=grammar)
        for schema in BAD_SCHEMAS:
            with pytest.raises(BadRequest) as refused:
                client.generate(PROMPT, max_tokens=8, json_schema=schema)
            with pytest.raises(BadRequest) as locally:  # the same words as the worker's compile here
                schema_grammar(schema if isinstance(schema, str) else canonical_json(schema))
            assert refused.value.message == locally.value.message
        assert client.generate(PROMPT, max_tokens=4, temperature=0).usage.completion_tokens == 4
    assert {row.pid for row in server.slots() if row.state is not SlotState.EMPTY} == pids
    assert not server.tracebacks()


def test_an_ambiguous_grammar_is_refused_by_its_code_over_zeromq(server: ServerProcess) -> None:
    with Client(server.address, timeout=60) as client:
        with pytest.raises(GrammarTooComplex) as refused:
            client.generate(PROMPT, max_tokens=8, grammar=AMBIGUOUS_GRAMMAR)
        assert refused.value.code is ErrorCode.GRAMMAR_TOO_COMPLEX
        with pytest.raises(GrammarTooComplex):
            client.generate(PROMPT, max_tokens=8, json_schema=AMBIGUOUS_PATTERN)
        assert client.generate(PROMPT, max_tokens=4, temperature=0).usage.completion_tokens == 4


def test_the_cli_takes_schema_and_grammar_files(server: ServerProcess, tmp_path: Any) -> None:
    schema_file, grammar_file = tmp_path / "s.json", tmp_path / "g.gbnf"
    schema_file.write_text(json.dumps(SCHEMAS[0]))
    grammar_file.write_text('root ::= "fine"')
    base = [sys.executable, "-m", "mpserve", "generate", PROMPT, "--address", server.address, "--temperature", "0",
            "--max-tokens", str(MAX_TOKENS), "--json"]
    out = subprocess.run(base + ["--json-schema", str(schema_file)], capture_output=True, text=True, timeout=60)
    assert_valid(json.loads(out.stdout)["text"], SCHEMAS[0])
    out = subprocess.run(base + ["--grammar", str(grammar_file)], capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout)["text"] == "fine"
    grammar_file.write_text("root ::= nothing")
    out = subprocess.run(base + ["--grammar", str(grammar_file)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "error: [bad_request]" in out.stderr and "not valid GBNF" in out.stderr
    assert "llama.cpp says \"Undefined rule identifier 'nothing'\"" in out.stderr, out.stderr  # llama.cpp's reason
