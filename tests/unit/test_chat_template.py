"""Rendering a GGUF's chat template: Hugging Face's conventions, in a sandbox, failures as BadRequest."""

from __future__ import annotations

import pytest

from mpserve.errors import BadRequest
from mpserve.gateway.chat import render
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
    ("{% for m in messages %}", "chat template failed"),
    ("{{ ''.__class__.__mro__ }}", "chat template failed"),  # the sandbox refuses reaching into Python
])
def test_a_template_that_refuses_or_fails_is_a_bad_request(source: str, problem: str) -> None:
    with pytest.raises(BadRequest, match=problem):
        render(ChatTemplate(source), [("user", "hi")])


def test_an_empty_template_is_false() -> None:
    assert not ChatTemplate() and ChatTemplate("x")
