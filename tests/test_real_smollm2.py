"""A second real model, instruction-tuned: SmolLM2 135M Instruct Q4_1 (llama architecture, a 49,152-token vocabulary,
its GGUF's own ChatML template, which renders no tools), served through the HTTP gateway:

- greedy chat completions equal llama-server's (``--jinja``, the same GGUF), when a llama-server binary is found;
- a tool round trip through the openai SDK and through LangChain: the forced call, then an answer in prose that
  uses the tool's result and ends by itself (the rendering of a tool's result a template without tools gets:
  ``mpserve.gateway.api.openai._results_as_user_turns``);
- the OpenAI Agents SDK runs an agent with two function tools to its final answer (xfail on Gemma 3 270M);
- ``reuse: exact`` in-process: each of many greedy streams on four slots, sharing a prefix longer than a chunk, gets
  the text it gets alone in a fresh engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from agent_run import run_agent
from conftest import RealModel, ServerProcess
from engines import serve
from gateway_thread import GatewayThread

from bench.procs import HttpServer, find_llama_server, free_port
from mpserve.engine.batch import BatchEngine
from mpserve.engine.settings import EngineSettings
from mpserve.wire.protocol import GenerateParams

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]

N_CTX = 2048
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colours.",
             "Explain in two sentences what a steam engine does."]
WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
RESULT = "It is 18 degrees and sunny in Paris."


@pytest.fixture(scope="module")
def gateway(smollm2: RealModel) -> Iterator[GatewayThread]:
    server = ServerProcess("--model", smollm2.path, "--name", "smollm2", "--parallel", "2", "--n-ctx", str(N_CTX),
                           "--reuse", "exact").wait_ready(120)  # exact: the same greedy text whatever came before
    gw = GatewayThread(server_name=server.name)
    yield gw
    gw.stop()
    assert not server.tracebacks()
    server.stop()


@pytest.fixture(scope="module")
def llama_server(smollm2: RealModel) -> Iterator[HttpServer]:
    binary = find_llama_server(None)
    if binary is None:
        pytest.skip("no llama-server binary: put one on PATH or under /opt/llama-server/ (bench/README.md)")
    port = free_port()
    repack = [] if smollm2.repack else ["--no-repack"]  # as mpserve serves it
    with HttpServer([binary, "--model", smollm2.path, "--jinja", "--host", "127.0.0.1", "--port", str(port),
                     "--threads", "1", "--threads-batch", "1", "--parallel", "1", "--ctx-size", str(N_CTX), *repack],
                    port, "/health") as peer:
        peer.wait_ready()
        yield peer


def _chat(url: str, messages: list[dict[str, Any]], **body: Any) -> dict[str, Any]:
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "messages": messages, "max_tokens": 48, "temperature": 0, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]  # type: ignore[no-any-return]


def test_greedy_chat_equals_llama_server_with_its_jinja_template(gateway: GatewayThread,
                                                                 llama_server: HttpServer) -> None:
    for question in QUESTIONS:
        for messages in ([{"role": "user", "content": question}],
                         [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": question}]):
            ours = _chat(gateway.url, messages)
            theirs = _chat(llama_server.url, messages, cache_prompt=False)
            assert (ours["message"]["content"], ours["finish_reason"]) == (
                theirs["message"]["content"], theirs["finish_reason"]), messages


def _openai_round_trip(gateway: GatewayThread) -> tuple[Any, Any]:
    """The forced call, and the reply to its result (tools still offered, tool_choice auto)."""
    client = gateway.openai()
    ask: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = client.chat.completions.create(model="smollm2", messages=ask, tools=[WEATHER], tool_choice="required",
                                          parallel_tool_calls=False, temperature=0, max_tokens=64).choices[0]
    history = [*ask, call.message.model_dump(exclude_none=True),
               *({"role": "tool", "tool_call_id": c.id, "content": RESULT} for c in call.message.tool_calls or ())]
    answer = client.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER], temperature=0,
                                            max_tokens=96).choices[0]
    return call, answer


def test_a_tool_round_trip_through_the_openai_sdk_ends_in_an_answer_from_the_result(gateway: GatewayThread) -> None:
    call, answer = _openai_round_trip(gateway)
    assert call.finish_reason == "tool_calls" and call.message.tool_calls, call
    assert [(c.function.name, json.loads(c.function.arguments)) for c in call.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls, answer
    assert "18" in answer.message.content and "<tool" not in answer.message.content, answer.message.content


def test_a_tool_round_trip_through_langchain(gateway: GatewayThread) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", model="smollm2", temperature=0,  # type: ignore[arg-type]
                     max_tokens=96, max_retries=0)  # type: ignore[call-arg]
    ask = HumanMessage("What is the weather in Paris?")
    called = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke([ask])
    assert [(c["name"], c["args"]) for c in called.tool_calls] == [("get_weather", {"city": "Paris"})]
    result = ToolMessage(RESULT, tool_call_id=called.tool_calls[0]["id"])
    answer = llm.bind_tools([WEATHER]).invoke([ask, called, result])
    assert not answer.tool_calls and answer.response_metadata["finish_reason"] == "stop", answer
    assert isinstance(answer.content, str) and "18" in answer.content


def test_the_agents_sdk_runs_an_agent_with_two_function_tools_to_its_answer(gateway: GatewayThread) -> None:
    """Strict here, where Gemma 3 270M (a base model) fails it: SmolLM2 answers from the tool's result."""
    ran, result = run_agent(gateway.url, "smollm2")
    assert ran and all(call in ("get_weather(Paris)", "get_population(Paris)") for call in ran), ran
    answer = result.final_output
    assert isinstance(answer, str) and ("18" in answer or "2 million" in answer), (ran, answer)
    assert [i.type for i in result.new_items].count("tool_call_item") == len(ran), result.new_items


# --- reuse: exact ----------------------------------------------------------------------------------------------

PREAMBLE = "".join(f"Rule {i}: a pupil who finishes the {topic} task early helps the pupil to the left. "
                   for i, topic in enumerate(["reading", "writing", "counting", "drawing", "singing"] * 8))


def _requests() -> list[tuple[str, GenerateParams]]:
    """Chats of a system prompt longer than a chunk, or none, each greedy, each asked twice: twice as many as
    slots."""
    out = []
    for i, question in enumerate(QUESTIONS):
        system = f"<|im_start|>system\n{PREAMBLE}<|im_end|>\n" if i % 2 == 0 else ""
        out.append((f"{system}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n",
                    GenerateParams(max_tokens=40 + 16 * i, temperature=0.0, stop=("<|im_end|>",),
                                   logprobs=2)))
    return out * 2


def _engine(model: RealModel, parallel: int) -> BatchEngine:
    return BatchEngine(EngineSettings(model.path, n_ctx=1024, parallel=parallel, threads=1, n_gpu_layers=0,
                                      repack=model.repack, reuse="exact"))


def test_exact_reuse_gives_each_stream_its_text_alone_with_a_cache_and_under_concurrency(smollm2: RealModel) -> None:
    """Eight streams on four slots, the second half asking the first half's chats again and reusing the preamble the
    first computed (a slot's cells, or copied), against each chat alone in a fresh engine."""
    load = _requests()
    engine = _engine(smollm2, 4)
    try:
        done = serve(engine, load)
    finally:
        engine.close()
    assert sum(c.reused_tokens > 0 for c in done) >= 2  # the preamble's chunks, reused
    together = [(c.text, c.logprobs) for c in done]  # the log-probabilities: a row that differs at all shows
    alone = []
    for request in load[:len(QUESTIONS)]:
        fresh = _engine(smollm2, 1)
        try:
            [completion] = serve(fresh, [request])
            alone.append((completion.text, completion.logprobs))
        finally:
            fresh.close()
    assert all(text for text, _ in alone) and together == alone * 2
