"""Streamed text: the first token goes out at once, later ones gathered per ``stream_interval``."""

from __future__ import annotations

import pytest

from mpserve import Client
from mpserve.worker.stream import ChunkStream

PROMPT = "Once upon a time"
TOKENS = 200


@pytest.mark.timeout(10)
def test_chunk_stream_sends_the_first_piece_at_once_then_gathers_until_flushed() -> None:
    sent: list[str] = []
    stream = ChunkStream(sent.append, interval=3600)
    stream.push("a")
    assert sent == ["a"]
    stream.push("b")
    stream.push("c")
    assert sent == ["a"]
    stream.flush()
    stream.flush()  # nothing left: nothing sent
    assert sent == ["a", "bc"]


@pytest.mark.timeout(10)
def test_chunk_stream_with_interval_zero_sends_every_piece() -> None:
    sent: list[str] = []
    stream = ChunkStream(sent.append, interval=0)
    for piece in "abc":
        stream.push(piece)
    stream.flush()
    assert sent == ["a", "b", "c"]


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
