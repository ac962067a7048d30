"""Prompt tokens taken from a cache, in the usage field each SDK reads: chat completions' and completions'
``usage.prompt_tokens_details.cached_tokens``, the Responses API's ``usage.input_tokens_details.cached_tokens``
and the Messages API's ``usage.cache_read_input_tokens``, whole and streamed, against the built-in tiny model.

A long prompt sent again is taken from the instance's cells (one instance, one slot: each request finds the
cells the one before left). Chat completions and completions show the worker's count as ``timings.cached_tokens``
beside the usage; the Responses and Messages APIs have no such key, so their field is compared with the count a
chat completion of the same prompt got, in the same state (the slot holding that prompt).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
from conftest import ServerProcess
from gateway_thread import GatewayThread

pytestmark = pytest.mark.timeout(120)

SYSTEM = " ".join(f"Rule {i}: answer in plain words and keep to the point of the question." for i in range(30))
MESSAGES: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayThread]:
    server = ServerProcess("--instances", "1", "--parallel", "1", "--n-ctx", "2048").wait_ready()
    gw = GatewayThread(server_name=server.name)
    yield gw
    gw.stop()
    assert not server.tracebacks()
    server.stop()


def chat_cached(gateway: GatewayThread) -> int:
    """A chat completion of the prompt: its cached tokens, as ``timings`` and ``usage`` both show them."""
    reply = gateway.openai().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **GREEDY)
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    timings = (reply.model_extra or {})["timings"]
    assert reply.usage.prompt_tokens_details.cached_tokens == timings["cached_tokens"]
    return timings["cached_tokens"]


def test_chat_completions_whole_and_streamed(gateway: GatewayThread) -> None:
    chat_cached(gateway)  # the prompt's cells are in the slot from now on
    cached = chat_cached(gateway)
    assert cached > len(SYSTEM) // 8  # the system prompt at least, in tokens of a few characters each
    chunks = list(gateway.openai().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, stream=True,
                                                           stream_options={"include_usage": True}, **GREEDY))
    last = chunks[-1]
    assert last.usage is not None and last.usage.prompt_tokens_details is not None
    assert last.usage.prompt_tokens_details.cached_tokens == (last.model_extra or {})["timings"]["cached_tokens"]
    assert last.usage.prompt_tokens_details.cached_tokens == cached


def test_completions_whole_and_streamed(gateway: GatewayThread) -> None:
    client = gateway.openai()
    for _ in range(2):
        reply = client.completions.create(model="tiny", prompt=SYSTEM, max_tokens=4, **GREEDY)
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens == (reply.model_extra or {})["timings"]["cached_tokens"]
    assert reply.usage.prompt_tokens_details.cached_tokens > 0
    chunks = list(client.completions.create(model="tiny", prompt=SYSTEM, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    last = chunks[-1]
    assert last.usage is not None and last.usage.prompt_tokens_details is not None
    assert last.usage.prompt_tokens_details.cached_tokens == (last.model_extra or {})["timings"]["cached_tokens"]
    assert last.usage.prompt_tokens_details.cached_tokens == reply.usage.prompt_tokens_details.cached_tokens


def test_responses_whole_and_streamed(gateway: GatewayThread) -> None:
    client = gateway.openai()
    kw: dict[str, Any] = dict(model="tiny", instructions=SYSTEM, input="hello", max_output_tokens=4, **GREEDY)
    chat_cached(gateway)
    cached = chat_cached(gateway)
    whole = client.responses.create(**kw)
    assert whole.usage is not None and whole.usage.input_tokens_details.cached_tokens == cached > 0
    streamed = list(client.responses.create(**kw, stream=True))[-1].response  # type: ignore[union-attr]
    assert streamed.usage is not None and streamed.usage.input_tokens_details.cached_tokens == cached
    assert streamed.usage.input_tokens == whole.usage.input_tokens  # the cached ones counted in, as OpenAI does


def test_messages_whole_and_streamed(gateway: GatewayThread) -> None:
    client = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=30)
    kw: dict[str, Any] = dict(model="tiny", max_tokens=4, extra_body=GREEDY, system=SYSTEM,
                              messages=[{"role": "user", "content": "hello"}])
    chat_cached(gateway)
    cached = chat_cached(gateway)
    prompt = gateway.openai().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                                      **GREEDY).usage.prompt_tokens  # type: ignore[union-attr]
    whole = client.messages.create(**kw)
    assert whole.usage.cache_read_input_tokens == cached > 0
    assert whole.usage.input_tokens + cached == prompt  # Anthropic counts the cached ones apart
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.usage.cache_read_input_tokens == cached
    assert final.usage.input_tokens + cached == prompt
