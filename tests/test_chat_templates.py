"""Chat templates chosen for a model (``mpserve.models.templates``): the families against llama-cpp-python's chat
formats, the choice when the GGUF has none, the ``chat_template`` setting, and Gemma 3 270M served with no
template configured against ``llama_cpp.Llama(chat_format="gemma")``."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RealModel, ServerProcess
from gateway_thread import GatewayThread
from llama_cpp import llama_chat_format

from mpserve import Client
from mpserve.config.loader import build
from mpserve.errors import ConfigError
from mpserve.gateway.api.chat import render
from mpserve.models import templates
from mpserve.models.maker import write_model
from mpserve.wire.protocol import ChatTemplate

pytestmark = pytest.mark.timeout(60)

HELLO = [{"role": "user", "content": "Say hello."}]
CONVERSATION = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Another one."}]


def _rendered(family: str, messages: list[dict[str, str]]) -> str:
    return render(ChatTemplate(templates.FAMILIES[family], "<s>", "</s>"), messages)


@pytest.mark.parametrize(("family", "formatter"), [
    ("gemma", llama_chat_format.format_gemma), ("llama3", llama_chat_format.format_llama3),
    ("qwen", llama_chat_format.format_qwen), ("mistral", llama_chat_format.format_mistral_instruct)],
    ids=["gemma", "llama3", "qwen", "mistral"])
def test_a_family_renders_as_llama_cpp_python_s_chat_format(family: str, formatter: Any) -> None:
    for messages in ([HELLO] if family == "mistral" else [HELLO, CONVERSATION]):  # theirs: "[/INST]reply</s>"
        assert _rendered(family, messages) == formatter(messages=messages).prompt


def test_gemma_puts_the_system_text_in_the_first_user_turn_and_tool_turns_as_the_tools_prompt_asks() -> None:
    messages = [{"role": "system", "content": "Be brief."}, *HELLO,
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "greet", "arguments": {"who": "you"}}}]},
                {"role": "tool", "content": "hello", "tool_call_id": "c1"}]
    assert _rendered("gemma", messages) == (
        "<start_of_turn>user\nBe brief.\n\nSay hello.<end_of_turn>\n"
        '<start_of_turn>model\n<tool_call>\n{"arguments": {"who": "you"}, "name": "greet"}\n</tool_call><end_of_turn>\n'
        "<start_of_turn>user\nThe tool returned: hello\nUsing this, answer my question.<end_of_turn>\n"
        "<start_of_turn>model\n")


TOOL_FORMATS = ("gpt-oss", "qwen3-coder", "glm", "kimi", "deepseek-v3")


def test_a_family_is_read_by_its_own_parser_and_the_others_by_the_tools_prompt_s() -> None:
    from mpserve.gateway.api.tools import parser_for

    assert {name: parser_for(source) for name, source in templates.FAMILIES.items()} == {
        name: name if name in TOOL_FORMATS else "hermes" for name in templates.FAMILIES}


@pytest.mark.parametrize("family", TOOL_FORMATS)
def test_a_tool_family_writes_the_history_s_calls_as_its_parser_reads_them(family: str) -> None:
    from mpserve.families import FAMILIES, read

    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris",
                                                                                               "days": 3}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "18 C", "tool_call_id": "c1"}]
    prompt = render(ChatTemplate(templates.FAMILIES[family], "", ""), messages, tools)
    turn = prompt.split("Weather?")[1].split("18 C")[0]
    found = read(FAMILIES[family], turn, {"get_weather": tools[0]["function"]["parameters"]})
    assert found is not None and [(f.name, json.loads(f.arguments)) for f in found[1]] == [
        ("get_weather", {"city": "Paris", "days": 3})], turn
    assert "Be brief." in prompt and "get_weather" in prompt.split("Weather?")[0]  # the tools shown before


def test_a_gguf_with_its_own_template_keeps_it_and_a_llama_gguf_without_gets_chatml(tmp_path: Path,
                                                                                    caplog: pytest.LogCaptureFixture
                                                                                    ) -> None:
    own = write_model(tmp_path / "own.gguf", "tiny", chat_template="{{ messages[0]['content'] }}")
    bare = write_model(tmp_path / "bare.gguf", "tiny")
    assert templates.template_for(None, str(own)) is None
    with caplog.at_level(logging.INFO, "mpserve.templates"):
        assert templates.template_for(None, str(bare)) == ""
        assert templates.template_for(None, str(bare)) == ""
    assert ["architecture (llama)" in r.getMessage() for r in caplog.records] == [True]  # once
    assert templates.template_for("gemma", str(own)) == templates.FAMILIES["gemma"]  # the setting wins


def test_an_ollama_style_hint_chooses_the_family_by_its_turn_markers(tmp_path: Path) -> None:
    bare = write_model(tmp_path / "hinted.gguf", "tiny")
    hint = "{{ range .Messages }}<start_of_turn>{{ .Role }}\n{{ .Content }}<end_of_turn>\n{{ end }}"
    assert templates.template_for(None, str(bare), hint) == templates.FAMILIES["gemma"]


def test_the_setting_takes_a_family_or_a_jinja_file_relative_to_the_config(tmp_path: Path) -> None:
    (tmp_path / "turns.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    config = build({"models": [{"path": "builtin:tiny", "chat_template": "turns.jinja"},
                               {"path": "builtin:tiny", "name": "b", "chat_template": "phi"}]}, base_dir=tmp_path)
    assert [m.chat_template for m in config.models] == [str(tmp_path / "turns.jinja"), "phi"]
    with pytest.raises(ConfigError, match=r"models\[0\].chat_template: 'gemma4' is neither a template family "
                                          r"\(chatml, llama3, gemma, mistral, phi, qwen, qwen3, deepseek, gpt-oss, "
                                          r"qwen3-coder, glm, kimi, deepseek-v3\) nor a file"):
        build({"models": [{"path": "builtin:tiny", "chat_template": "gemma4"}]})
    with pytest.raises(ConfigError, match="broken.jinja' is not a Jinja2 chat template: line 1"):
        build({"models": [{"path": "builtin:tiny", "chat_template": "broken.jinja"}]}, base_dir=tmp_path)


@pytest.mark.timeout(60)
def test_a_configured_template_reaches_the_gateway(start_server) -> None:
    server = start_server("--model", "builtin:tiny", "--chat-template", "llama3").wait_ready()
    with Client(server.address) as client:
        assert client.stats().models["tiny"].chat_template == templates.FAMILIES["llama3"]


# --- a template that loops for ever or fails, served by a real gateway -----------------------------------

TEMPLATE_BUDGET_S = 2.0  # the gateway's default --template-timeout
HOSTILE = ("{% if messages[-1]['content'] == 'spin' %}"
           "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}"
           "{% if messages[-1]['content'] == 'divide' %}{{ 1/0 }}{% endif %}"
           "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: ")


@pytest.fixture
def hostile(start_server, tmp_path: Path) -> Iterator[GatewayThread]:
    (tmp_path / "hostile.jinja").write_text(HOSTILE)
    server = start_server("--model", "builtin:tiny", "--chat-template", str(tmp_path / "hostile.jinja")).wait_ready()
    gateway = GatewayThread(server_name=server.name)
    yield gateway
    gateway.stop()


def _chat(gateway: GatewayThread, content: str, path: str = "/v1/chat/completions") -> httpx.Response:
    body = ({"model": "tiny", "max_output_tokens": 2, "input": content} if path == "/v1/responses" else
            {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": content}]})
    return httpx.post(gateway.url + path, json=body, timeout=60)


def test_a_template_that_loops_for_ever_is_a_400_within_its_budget_while_health_is_answered(
        hostile: GatewayThread) -> None:
    """Jinja2's sandbox caps one range, not a loop inside a loop; rendered on the event loop, such a template
    held up every request and /health for as long as it ran."""
    assert _chat(hostile, "hi").status_code == 200
    answers: list[httpx.Response] = []
    started = time.monotonic()
    spinning = threading.Thread(target=lambda: answers.append(_chat(hostile, "spin")))
    spinning.start()
    health: list[float] = []
    while spinning.is_alive() and time.monotonic() - started < TEMPLATE_BUDGET_S + 30:
        asked = time.monotonic()
        assert hostile.get("/health").status_code == 200
        health.append(time.monotonic() - asked)
    spinning.join(60)
    took = time.monotonic() - started
    assert answers and answers[0].status_code == 400, answers[0].text if answers else "no answer"
    error = answers[0].json()["error"]
    assert error["code"] == "bad_request" and error["message"].startswith(
        f"the chat template of model 'tiny' did not finish within {TEMPLATE_BUDGET_S:g} s"), error
    assert took < TEMPLATE_BUDGET_S + 3, took  # the budget is the documented bound
    assert len(health) >= 5, health  # answered all along, not once the render ended
    assert _chat(hostile, "hi").status_code == 200


def test_any_template_error_is_a_400_naming_the_template_on_every_chat_route(hostile: GatewayThread) -> None:
    for path in ("/v1/chat/completions", "/v1/responses"):
        answer = _chat(hostile, "divide", path)
        assert answer.status_code == 400 and answer.headers["content-type"] == "application/json", answer.text
        assert answer.json()["error"]["message"] == ("the chat template of model 'tiny' failed at line 1: "
                                                     "ZeroDivisionError: division by zero"), answer.text


# --- Gemma 3 270M, whose GGUF has no chat template ------------------------------------------------------


@pytest.fixture(scope="module")
def gemma(real_model: RealModel) -> Iterator[tuple[ServerProcess, GatewayThread]]:
    server = ServerProcess("--model", real_model.path, "--name", "gemma", "--n-ctx", "512",
                           "--reuse", "exact").wait_ready(120)  # compared with a fresh computation
    gateway = GatewayThread(server_name=server.name)
    yield server, gateway
    gateway.stop()
    server.stop()


@pytest.mark.real
@pytest.mark.timeout(300)
def test_gemma_without_a_template_chats_in_its_own_turns_as_llama_cpp_python(
        real_model: RealModel, gemma: tuple[ServerProcess, GatewayThread]) -> None:
    server, gateway = gemma
    with Client(server.address) as client:
        assert "<start_of_turn>" in client.stats().models["gemma"].chat_template
    assert any("gemma family's, chosen by its architecture, gemma3" in line for line in server.log)
    llm = real_model.llama(n_ctx=512, chat_format="gemma")
    try:
        for messages in (HELLO, CONVERSATION):
            reply = gateway.openai().chat.completions.create(model="gemma", messages=messages, max_tokens=24,
                                                             temperature=0)
            llm.reset()
            expected = llm.create_chat_completion(messages=messages, max_tokens=24, temperature=0,
                                                  repeat_penalty=1.0)
            assert reply.choices[0].message.content == expected["choices"][0]["message"]["content"]
            assert reply.choices[0].message.content.strip()  # not the empty reply ChatML gave
            assert reply.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    finally:
        llm.close()
