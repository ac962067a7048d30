"""Rendering a GGUF's chat template: Hugging Face's conventions, in a sandbox, failures as BadRequest."""

from __future__ import annotations

import re
import time

import pytest

from mpserve.errors import BadRequest
from mpserve.gateway.api.chat import TemplateBudget, render
from mpserve.wire.protocol import ChatTemplate

pytestmark = pytest.mark.timeout(10)

LLAMA3_LIKE = ChatTemplate(
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
    bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


def test_messages_render_with_a_generation_prompt_and_no_bos_since_the_engine_adds_it() -> None:
    prompt = render(LLAMA3_LIKE, [("system", "Be brief. "), ("user", "Hi")])
    assert prompt == ("<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                      "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                      "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_eos_token_and_loop_controls_are_available() -> None:
    chat = ChatTemplate("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                        "{{ m.content }}{{ eos_token }}{% endfor %}", eos_token="</s>")
    assert render(chat, [("system", "ignored"), ("user", "a"), ("assistant", "b")]) == "a</s>b</s>"


@pytest.mark.parametrize("source, problem", [
    ("{{ raise_exception('system messages are not supported') }}",
     "refused the messages: system messages are not supported"),
    ("{% for m in messages %}", "chat template is not valid Jinja2: line 1"),
    ("{{ ''.__class__.__mro__ }}", "chat template failed"),  # the sandbox refuses reaching into Python
])
def test_a_template_that_refuses_or_fails_is_a_bad_request(source: str, problem: str) -> None:
    with pytest.raises(BadRequest, match=problem):
        render(ChatTemplate(source), [("user", "hi")])


def test_an_empty_template_is_false() -> None:
    assert not ChatTemplate() and ChatTemplate("x")


BUDGET = TemplateBudget(seconds=0.5, max_chars=200_000)  # over Jinja2's own cap on a range
ROOMY = TemplateBudget(seconds=60, max_chars=200_000)  # for what is not about time: a starved core is no verdict


@pytest.mark.parametrize("source, problem", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "did not finish within 0.5 s"),  # the sandbox caps one range, not nesting
    ("{% set s = 'x' * 5000 %}{% for a in s %}{% for b in s %}{% for c in s %}{% endfor %}{% endfor %}{% endfor %}",
     "did not finish within 0.5 s"),  # no call at all inside the loops
    ("{% macro f(n) %}{% if n < 8 %}{% for i in range(100) %}{{ f(n + 1) }}{% endfor %}{% endif %}{% endmacro %}"
     "{{ f(0) }}", "did not finish within 0.5 s"),
    ("{% for i in range(100000) %}{{ 'abcdefgh' }}{% endfor %}", "wrote over 200000 characters"),
    ("{{ 'x' * 10**9 }}", "would build a value over 200000 characters"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "would build a string over 200000 characters"),
    ("{{ 'x' | center(10**9) }}", "passed 1e+09 to a function"),
    ("{% set s = 'x' * 5000 %}{{ s | replace('x', s) }}", "would build a string over 200000 characters"),
    ("{{ 10 ** 1000000000 }}", "would build a number of digits over 200000"),
])
def test_a_template_over_its_time_or_output_budget_is_a_bad_request_within_it(source: str, problem: str) -> None:
    timed = "did not finish" in problem
    started = time.monotonic()
    with pytest.raises(BadRequest, match=re.escape(f"the chat template of model 'm' {problem}")):
        render(ChatTemplate(source), [("user", "hi")], model="m", budget=BUDGET if timed else ROOMY)
    if timed:  # the budget ends it: the loops would run for hours (slack for a starved core)
        assert time.monotonic() - started < BUDGET.seconds + 10


@pytest.mark.parametrize("source, problem", [
    ("hello\n{{ 1/0 }}", "failed at line 2: ZeroDivisionError: division by zero"),
    ("{{ messages[3].content }}", "failed at line 1: UndefinedError"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "failed at line 1: RecursionError"),
])
def test_any_error_of_a_template_is_a_bad_request_naming_it_and_where(source: str, problem: str) -> None:
    with pytest.raises(BadRequest, match=f"the chat template of model 'm' {problem}"):
        render(ChatTemplate(source), [("user", "hi")], model="m", budget=ROOMY)


def test_loops_keep_their_loop_variable_and_recursion_within_the_budget() -> None:
    source = ("{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ m.content ~ '!' }}{% endfor %}"
              "{% for x in [[1, [2]], 3] recursive %}{% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}"
              "{% endif %}{% endfor %}")
    assert render(ChatTemplate(source), [("user", "a"), ("assistant", "b")], budget=ROOMY) == "1/2a!2/2b!123"


def test_a_large_number_may_be_filtered_and_written() -> None:
    source = "{{ 10**12 }} {{ (10**12) | string }} {{ (10**12) | round(2) }}"
    assert render(ChatTemplate(source), [("user", "a")], budget=ROOMY) == "1000000000000 1000000000000 1000000000000"
