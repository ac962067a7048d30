"""Streamed text: the first token goes out at once, later ones gathered per ``stream_interval``."""

from __future__ import annotations

import pytest

from mpserve import Client

PROMPT = "Once upon a time"
TOKENS = 200


def stream_chunks(address: str) -> tuple[list[str], str, int]:
    with Client(address) as client:
        stream = client.stream(PROMPT, max_tokens=TOKENS, temperature=0)
        chunks = list(stream)
        assert stream.result is not None
        return chunks, stream.result.text, stream.result.usage.completion_tokens


@pytest.mark.timeout(120)
@pytest.mark.parametrize("parallel", ["1", "2"], ids=["one-at-a-time", "batched"])
def test_stream_interval_gathers_tokens_and_zero_streams_each(start_server, parallel: str) -> None:
    each = start_server("--parallel", parallel, "--stream-interval", "0").wait_ready()
    gathered = start_server("--parallel", parallel, "--stream-interval", "0.5").wait_ready()
    chunks, text, tokens = stream_chunks(each.address)
    assert tokens == TOKENS and len(chunks) == TOKENS and "".join(chunks) == text
    few, same_text, _ = stream_chunks(gathered.address)
    assert same_text == text and "".join(few) == text
    assert few[0] == chunks[0], "the first token is sent on its own, at once"
    assert 2 <= len(few) < TOKENS
