"""A GBNF grammar's ambiguity (``mpserve.engine.ambiguity``): the most parse stacks one step may hold, read from the
text alone; the grammars mpserve compiles from JSON Schemas hold few, alternatives that begin alike hold one each."""

from __future__ import annotations

import json

import pytest
from structured_cases import SCHEMAS

from mpserve.engine.ambiguity import MAX_AMBIGUITY, ambiguity
from mpserve.structured import JSON_OBJECT_SCHEMA, canonical_json, schema_grammar

pytestmark = pytest.mark.timeout(30)


def alternatives(n: int) -> str:
    return " | ".join(f'"the same beginning, then {i}"' for i in range(n))


def test_the_json_grammars_of_schemas_are_far_below_the_limit() -> None:
    measured = [ambiguity(schema_grammar(canonical_json(schema))) for schema in SCHEMAS]
    assert max(measured) * 4 <= MAX_AMBIGUITY, measured
    assert ambiguity(schema_grammar(JSON_OBJECT_SCHEMA)) * 4 <= MAX_AMBIGUITY


@pytest.mark.parametrize(("grammar", "stacks"), [
    ('root ::= "a"', 1),
    ('root ::= ("yes" | "no") " " [0-9] [0-9]', 2),
    ("root ::= " + alternatives(40), 40),
    ('root ::= "x" (' + alternatives(40) + ")", 40),  # in a group after a terminal
    ('root ::= "x" r\nr ::= ' + alternatives(40) + '\nr ::= "y"', 41),  # a rule given twice: both counted
    ('root ::= "x" r\n# a comment | "z"\nr ::= ' + alternatives(30), 30),
    ('root ::= a? b* ("c" | "d"){0,3} "e"\na ::= "a1" | "a2"\nb ::= "b"', 6),  # what may be empty lets more count
    ('root ::= a+ "e"\na ::= "a1" | "a2"', 2),  # at least once: what follows does not count
    ('root ::= "" ("p" | "q")', 2),  # the empty string matches nothing
    ('root ::= r "a"\nr ::= root | "b"', 1),  # left recursion (llama.cpp refuses it) counts nothing
])
def test_a_grammar_holds_a_stack_per_alternative_it_may_be_at(grammar: str, stacks: int) -> None:
    assert ambiguity(grammar) == stacks


def test_the_measure_stops_past_the_limit_and_is_linear_in_the_text() -> None:
    assert ambiguity("root ::= " + alternatives(340)) == MAX_AMBIGUITY + 1
    pattern = {"type": "string", "pattern": "^(" + "|".join(f"ab{i}" for i in range(150)) + ")$"}
    assert ambiguity(schema_grammar(json.dumps(pattern))) > MAX_AMBIGUITY
    skippable = "root ::= " + " ".join(f"x{i}" for i in range(3000)) + "\n" + "\n".join(
        f'x{i} ::= "a"?' for i in range(3000))  # every one may be skipped: a stack for each
    assert len(skippable) > 50_000 and ambiguity(skippable) > MAX_AMBIGUITY
