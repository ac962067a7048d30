"""A real model (Gemma 3 270M Q4_K_M: a 262,144-token vocabulary, sliding-window attention, byte tokens)
served by real servers, against ``llama_cpp.Llama.create_completion`` computing each prompt from scratch.

One server per ``parallel`` setting for the whole module; greedy, few tokens, so the file stays short.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import RealModel, ServerProcess

from mpserve import AsyncClient, Client
from mpserve.engine.sequence import PROMPT_CHUNK

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]

N_CTX = 1024
MAX_TOKENS = 12
PROMPTS = ["Here is a long essay about how a steam engine works.\n\n",
           "Here is a long essay about the history of the Roman empire.\n\n",
           "The capital of France is"]
PREAMBLE = "".join(f"Rule {i}: a pupil who finishes the {topic} task early helps the pupil to the left. "
                   for i, topic in enumerate(["reading", "writing", "counting", "drawing", "singing"] * 6))
QUESTIONS = ["Question: Why is the sky blue?\nAnswer:", "Question: Who built the pyramids of Giza?\nAnswer:",
             "Question: What does a steam engine turn into motion?\nAnswer:",
             "Question: How far away is the Moon?\nAnswer:"]
EMOJI = "Emoji: 🦜🦩🪿 and more emoji:"
CHAT = "<start_of_turn>user\nSay hello.<end_of_turn>\n<start_of_turn>model\n"


class Reference:
    """create_completion, greedy and without a penalty, from a fresh state for every prompt (a Llama reuses
    the prefix its last prompt left, which is the very thing under test), with mpserve's defaults:
    flash attention on (auto, on a CPU), one thread, the same weight layout."""

    def __init__(self, model: RealModel) -> None:
        self.llm = model.llama(n_ctx=N_CTX)
        self._done: dict[tuple[Any, ...], dict[str, Any]] = {}

    def complete(self, prompt: str, max_tokens: int = MAX_TOKENS, logit_bias: dict[int, float] | None = None
                 ) -> dict[str, Any]:
        key = (prompt, max_tokens, tuple(sorted((logit_bias or {}).items())))
        if key not in self._done:
            self.llm.reset()
            out = self.llm.create_completion(prompt, max_tokens=max_tokens, temperature=0, repeat_penalty=1.0,
                                             logit_bias=logit_bias)
            self._done[key] = {"text": out["choices"][0]["text"], "finish_reason": out["choices"][0]["finish_reason"],
                               **out["usage"]}
        return self._done[key]

    def n_tokens(self, text: str, special: bool) -> int:
        return len(self.llm.tokenize(text.encode(), add_bos=True, special=special))


@pytest.fixture(scope="module")
def reference(real_model: RealModel) -> Iterator[Reference]:
    ref = Reference(real_model)
    yield ref
    ref.llm.close()


@pytest.fixture(scope="module", params=[1, 4], ids=["parallel-1", "parallel-4"])
def server(request: pytest.FixtureRequest, real_model: RealModel) -> Iterator[ServerProcess]:
    server = ServerProcess("--model", real_model.path, "--name", "gemma", "--parallel", str(request.param),
                           "--n-ctx", str(N_CTX), "--stream-interval", "0",
                           "--reuse", "exact").wait_ready(120)  # repack: auto; exact: compared with fresh ones
    yield server
    server.stop()


def _run(client: Client, prompt: str, stream: bool, max_tokens: int = MAX_TOKENS) -> tuple[Any, list[str]]:
    """The result, and the text pieces a stream handed out (none when not streamed)."""
    if not stream:
        return client.generate(prompt, max_tokens=max_tokens, temperature=0), []
    handle = client.stream(prompt, max_tokens=max_tokens, temperature=0)
    pieces = list(handle)
    assert handle.result is not None
    assert "".join(pieces) == handle.result.text
    return handle.result, pieces


def _assert_same(result: Any, expected: dict[str, Any]) -> None:
    assert result.text == expected["text"]
    assert result.finish_reason == expected["finish_reason"]
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (
        expected["prompt_tokens"], expected["completion_tokens"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_greedy_output_equals_create_completion(server: ServerProcess, reference: Reference, stream: bool) -> None:
    with Client(server.address) as client:
        for prompt in PROMPTS + [CHAT]:
            _assert_same(_run(client, prompt, stream)[0], reference.complete(prompt))


def test_a_slots_own_cached_prefix_changes_nothing(server: ServerProcess, reference: Reference) -> None:
    """The issue's sequence (a short shared prefix: computed again), then one sharing a whole chunk."""
    long_prompts = [PREAMBLE + QUESTIONS[0], PREAMBLE + QUESTIONS[1]]
    assert reference.n_tokens(PREAMBLE, special=True) > PROMPT_CHUNK
    with Client(server.address) as client:
        for i, prompt in enumerate([PROMPTS[0], PROMPTS[1], PROMPTS[0]] + long_prompts + long_prompts[:1]):
            result, _ = _run(client, prompt, stream=i % 2 == 1)
            _assert_same(result, reference.complete(prompt))
            if i == 2:
                assert result.timings.cached_tokens == 0  # shares less than a chunk with what a slot holds
            if i == 5:
                assert result.timings.cached_tokens == PROMPT_CHUNK


def test_concurrent_questions_after_a_shared_preamble(server: ServerProcess, reference: Reference) -> None:
    """Four at once after a preamble longer than a chunk: at parallel 4 the first computes its first chunk,
    the others copy it; in the second round every slot holds it."""
    prompts = [PREAMBLE + question for question in QUESTIONS]

    async def round_of_four() -> list[Any]:
        async with AsyncClient(server.address, timeout=240) as client:
            return await asyncio.gather(*(client.generate(p, max_tokens=MAX_TOKENS, temperature=0) for p in prompts))

    cached = []
    for _ in range(2):
        for prompt, result in zip(prompts, asyncio.run(round_of_four()), strict=True):
            _assert_same(result, reference.complete(prompt))
            cached.append(result.timings.cached_tokens)
    assert set(cached) <= {0, PROMPT_CHUNK} and cached.count(PROMPT_CHUNK) >= 3


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_end_of_text_ends_the_request_with_stop_and_is_neither_counted_nor_printed(
        server: ServerProcess, reference: Reference, stream: bool) -> None:
    """The base model never ends by itself in a few tokens; a bias on <end_of_turn> (an end-of-generation
    token of Gemma's vocabulary) makes it end after a short reply, here and in create_completion alike."""
    end_of_turn = reference.llm._model.token_eot()  # <end_of_turn>
    bias = {end_of_turn: 14.0}
    expected = reference.complete(CHAT, 32, logit_bias=bias)
    assert expected["finish_reason"] == "stop" and 0 < expected["completion_tokens"] < 32
    with Client(server.address) as client:
        if stream:
            handle = client.stream(CHAT, max_tokens=32, temperature=0, logit_bias=bias)
            pieces = list(handle)
            result = handle.result
            assert result is not None and "".join(pieces) == result.text
        else:
            result = client.generate(CHAT, max_tokens=32, temperature=0, logit_bias=bias)
    _assert_same(result, expected)
    assert "<end_of_turn>" not in result.text and "<eos>" not in result.text


def test_characters_split_over_tokens_stream_whole(server: ServerProcess, reference: Reference) -> None:
    expected = reference.complete(EMOJI, 10)
    assert expected["completion_tokens"] == 10  # create_completion went no further to finish a character
    split = [ch for ch in expected["text"] if reference.n_tokens(ch, special=False) > 2]  # BOS + 2 or more
    assert split, "the completion should hold a character made of several byte tokens"
    with Client(server.address) as client:
        result, pieces = _run(client, EMOJI, stream=True, max_tokens=10)
    _assert_same(result, expected)
    assert all("\ufffd" not in piece for piece in pieces)
    assert any(ch in piece for piece in pieces for ch in split)


def test_special_token_text_in_a_prompt_is_parsed_as_the_token(server: ServerProcess,
                                                               reference: Reference) -> None:
    with Client(server.address) as client:
        result = client.generate(CHAT, max_tokens=4, temperature=0)
    assert result.usage.prompt_tokens == reference.n_tokens(CHAT, special=True) < reference.n_tokens(CHAT, False)
