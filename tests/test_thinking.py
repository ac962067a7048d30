"""Thinking as a phase of the sequence (``mpserve.engine.thinking``), on the built-in tiny model, whose random
weights never write the end tag: the budget closes the thinking to the token, the request's JSON schema holds
from the end tag on and never inside the thinking, and a budget past the context is refused."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import msgspec
import pytest
from engines import finish, serve

from mpserve.config.reasoning import Reasoning
from mpserve.engine.batch import BatchEngine
from mpserve.engine.settings import EngineSettings
from mpserve.engine.thinking import closing_tokens
from mpserve.errors import BadRequest
from mpserve.models.builtin import builtin_model_path
from mpserve.structured import canonical_json
from mpserve.wire.protocol import GenerateParams

PROMPT = "<|im_start|>user\nWhat is two and two?<|im_end|>\n<|im_start|>assistant\n<think>\n"
END = "</think>"
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}, "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}
N_CTX = 1024


@pytest.fixture(scope="module")
def engine() -> Iterator[BatchEngine]:
    engine = BatchEngine(EngineSettings(str(builtin_model_path("tiny")), n_ctx=N_CTX, parallel=4, threads=1,
                                        n_gpu_layers=0, reasoning=Reasoning(close="Time to answer.")))
    yield engine
    engine.close()


def forced(engine: BatchEngine) -> int:
    """How many tokens the budget forces: the close message, a newline and the end tag."""
    return len(closing_tokens(lambda text: engine.tokenize(text, False), engine.token_bytes, "Time to answer.\n" + END))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("budget", [0, 1, 7, 40])
def test_the_budget_closes_the_thinking_to_the_token(engine: BatchEngine, budget: int) -> None:
    params = GenerateParams(max_tokens=120, temperature=1.0, seed=budget, ignore_eos=True, reasoning_end=END,
                            reasoning_budget=budget)
    [done] = serve(engine, [(PROMPT, params)])
    thinking, closed, _answer = done.text.partition(END)
    assert closed and thinking.endswith("Time to answer.\n")
    assert done.reasoning_tokens == budget + forced(engine)
    assert done.completion_tokens == 120


@pytest.mark.timeout(300)
def test_a_json_schema_holds_after_the_thinking_for_100_seeds(engine: BatchEngine) -> None:
    """Schema-valid JSON after non-empty thinking, 100 of 100 seeds (four slots at a time, in-process)."""
    requests = [(PROMPT, GenerateParams(max_tokens=200, temperature=1.0, seed=seed, reasoning_end=END,
                                        reasoning_budget=12, json_schema=canonical_json(SCHEMA)))
                for seed in range(100)]
    done = serve(engine, requests)
    assert len({c.text for c in done}) > 90  # seeds that sample differently, not one reply a hundred times
    for completion in done:
        thinking, closed, answer = completion.text.partition(END)
        assert closed and thinking.removesuffix("Time to answer.\n").strip(), completion.text  # it thought freely
        assert completion.reasoning_tokens > 0
        jsonschema.validate(json.loads(answer), SCHEMA)
        assert completion.finish_reason == "stop"


@pytest.mark.timeout(60)
def test_an_effort_takes_the_model_s_budget_cut_to_the_context_and_a_budget_past_it_is_refused(
        engine: BatchEngine) -> None:
    low = Reasoning().low
    params = GenerateParams(max_tokens=8, temperature=0.0, reasoning_end=END, reasoning_effort="low")
    [done] = serve(engine, [(PROMPT, params)])
    assert done.reasoning_tokens == 8 < low  # still thinking when max_tokens ended it
    high = GenerateParams(max_tokens=8, temperature=0.0, reasoning_end=END, reasoning_effort="high")
    assert Reasoning().high > N_CTX and serve(engine, [(PROMPT, high)])[0].reasoning_tokens == 8  # cut to the context
    with pytest.raises(BadRequest, match=f"'reasoning_budget' = {N_CTX + 1} is more than the context holds"):
        engine.admit(0, PROMPT, GenerateParams(reasoning_end=END, reasoning_budget=N_CTX + 1), lambda t, n: True)
    assert engine.free_slots() == [0, 1, 2, 3]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["thinking", "closing", "answer"])
def test_a_reply_resumed_from_carried_tokens_goes_on_in_its_phase(engine: BatchEngine, where: str) -> None:
    """Carried over from a lost instance in its thinking, in its forced end or in its answer, the reply ends its
    thinking where it would have and answers under its schema as it would have."""
    cut = {"thinking": 3, "closing": 8 + forced(engine) // 2, "answer": 8 + forced(engine) + 2}[where]
    params = GenerateParams(max_tokens=40, temperature=0.0, reasoning_end=END, reasoning_budget=8,
                            json_schema=canonical_json(SCHEMA))
    seen: list[int] = []

    def record(text: str, n: int) -> bool:
        seen[:] = engine.tokens(0)
        return True

    engine.admit(0, PROMPT, params, record)
    whole = finish(engine)[0]
    engine.admit(0, PROMPT, params, lambda text, n: True, carried=seen[:cut])
    resumed = finish(engine)[0]
    assert (resumed.text, resumed.reasoning_tokens) == (whole.text, whole.reasoning_tokens)
    assert whole.reasoning_tokens == 8 + forced(engine) and len(seen) > cut


@pytest.mark.timeout(60)
def test_a_stop_string_ends_the_reply_in_its_thinking_as_llama_server_s_does(engine: BatchEngine) -> None:
    """llama-server looks for stop strings in all the text generated, thinking included (its slot's
    ``find_stopping_strings`` on ``generated_text``): a stop string the thinking writes ends the reply there."""
    params = GenerateParams(max_tokens=40, temperature=0.0, reasoning_end=END, reasoning_budget=30)
    [whole] = serve(engine, [(PROMPT, params)])
    thinking = whole.text.partition(END)[0]
    stop = thinking[len(thinking) // 2:][:4]
    assert stop.strip() and len(thinking) > 8, whole.text
    [cut] = serve(engine, [(PROMPT, msgspec.structs.replace(params, stop=(stop,)))])
    assert cut.text == thinking[:thinking.index(stop)] and cut.finish_reason == "stop"
    assert 0 < cut.reasoning_tokens < 30
