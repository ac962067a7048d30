"""ChunkStream: a streamed request's first piece goes at once, later ones gathered per interval."""

from __future__ import annotations

import pytest

from mpserve.worker.stream import ChunkStream


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
