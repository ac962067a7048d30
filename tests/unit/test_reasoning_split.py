"""The gateway's reasoning rules (``mpserve.gateway.api.reasoning``), alone: a reply's text split at the end tag the
same however it arrives in pieces, a prompt opened or closed for the thinking, and bad controls refused by name."""

from __future__ import annotations

import pytest

from mpserve.errors import BadRequest
from mpserve.gateway.api import reasoning
from mpserve.wire.protocol import GenerateParams

pytestmark = pytest.mark.timeout(10)

REPLY = "\nLet me see: 2 < 3, and </th is not it.\n\n</think>\n\nThe answer is 4."


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 100])
def test_a_reply_splits_the_same_in_any_pieces(size: int) -> None:
    split = reasoning.Split("</think>")
    parts = [split.push(piece) for piece in pieces(REPLY, size)] + [split.flush()]
    assert "".join(r for r, _ in parts) == "Let me see: 2 < 3, and </th is not it."
    assert "".join(c for _, c in parts) == "The answer is 4."
    first_answer = next(i for i, (_, c) in enumerate(parts) if c)
    assert not any(r for r, _ in parts[first_answer + 1:])  # no thinking after the answer began
    assert reasoning.split(REPLY, "</think>") == ("Let me see: 2 < 3, and </th is not it.", "The answer is 4.")


def test_thinking_the_end_tag_never_closed_is_all_reasoning() -> None:
    assert reasoning.split("still thinking </thi", "</think>") == ("still thinking </thi", "")


def test_a_prompt_is_opened_for_the_thinking_or_closed_against_it() -> None:
    on, off = reasoning.Ask(), reasoning.Ask(enabled=False)
    qwen, deepseek = "<|im_start|>assistant\n", "<｜Assistant｜><think>\n"
    assert on.prompt(reasoning.THINK, qwen) == qwen + "<think>\n"
    assert on.prompt(reasoning.THINK, deepseek) == deepseek
    assert off.prompt(reasoning.THINK, qwen) == qwen
    assert off.prompt(reasoning.THINK, deepseek) == deepseek + "\n</think>\n\n"
    assert off.template_variables() == {"enable_thinking": False}
    params, thinks = on.params(reasoning.THINK, GenerateParams())
    assert thinks and params.reasoning_end == "</think>" and params.reasoning_budget is None


@pytest.mark.parametrize(("given", "refusal"), [
    ({"reasoning_effort": "extreme"}, "'reasoning_effort' must be one of none, minimal, low, medium, high"),
    ({"reasoning_budget": -1}, "'reasoning_budget' must be a number of tokens, 0 or more"),
    ({"reasoning_budget": True}, "'reasoning_budget' must be a number of tokens"),
    ({"reasoning_format": "xml"}, "'reasoning_format' must be one of none, deepseek, auto"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, "'chat_template_kwargs.enable_thinking' must be a bool"),
    ({"chat_template_kwargs": {"messages": []}}, "'chat_template_kwargs' may not set messages"),
])
def test_bad_controls_are_refused_by_name(given: dict[str, object], refusal: str) -> None:
    with pytest.raises(BadRequest, match=refusal):
        reasoning.Ask.parse(given)


def test_thinking_asked_of_a_template_that_does_not_think_names_the_field() -> None:
    with pytest.raises(BadRequest, match="'reasoning_budget' asks for thinking"):
        reasoning.Ask.parse({"reasoning_budget": 5}).params(None, GenerateParams())
    assert reasoning.Ask.parse({"reasoning_effort": "none"}).params(None, GenerateParams())[1] is False
    assert reasoning.tags_of("{{ messages }}") is None
