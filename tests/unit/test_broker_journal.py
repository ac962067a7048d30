"""The broker's journal file (``mpserve.server.journal``) on its own: what a next start reads of it (the rows begun
and neither ended nor lost, with their tokens and text), a frame cut short, a compaction, a file that is not ours."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mpserve.server import journal
from mpserve.server.journal import Journal
from mpserve.server.state import Pending
from mpserve.wire import protocol as wire

pytestmark = pytest.mark.timeout(10)


def _row(ticket: str, rid: str) -> Pending:
    return Pending(ticket, b"client", wire.Request(rid, "Once upon a time", tenant="t"), "tiny", 0.0, None)


def _streamed(book: Journal, p: Pending, texts: list[str]) -> None:
    """``p`` streamed ``texts``, a token each, as the broker journals its CHUNKs."""
    for text in texts:
        body, token = wire.pack(wire.Chunk(p.request.id, text)), wire.pack_tokens([100 + len(p.generated) // 4])
        p.generated += token
        assert p.kept is not None
        p.kept.append(body)
        book.chunk(p, token, body)


def test_a_next_start_reads_the_live_rows_with_their_tokens_and_text_and_not_the_ended_or_lost(tmp_path: Path) -> None:
    path = tmp_path / "s.journal"
    book = Journal(path)
    live, ended, lost, queued = _row("t1", "a"), _row("t2", "b"), _row("t3", "c"), _row("t4", "d")
    for p in (live, ended, lost, queued):
        book.begin(p)
    _streamed(book, live, ["Once", " more"])
    _streamed(book, ended, ["x"])
    book.end(ended)
    book.chunk(lost, None, b"")  # a CHUNK without its token ids: it cannot be resumed
    book.flush(list)
    _streamed(book, live, ["!"])
    book.flush(list)
    assert os.stat(path).st_mode & 0o777 == 0o600
    rows = {p.request.id: (p, text) for p, text in journal.read(path)}
    assert sorted(rows) == ["a", "d"]
    p, text = rows["a"]
    assert (text, wire.unpack_tokens(bytes(p.generated)), p.tenant, p.model) == ("Once more!", [100, 101, 102], "t",
                                                                                "tiny")
    assert rows["d"][1] == "" and not rows["d"][0].generated
    book.records.append(journal.Record(journal.BEGIN, "t5", wire.pack(_row("t5", "e").request)))
    book.flush(list)
    with open(path, "r+b") as file:  # the server died writing its last frame
        file.truncate(os.path.getsize(path) - 3)
    assert sorted(p.request.id for p, _ in journal.read(path)) == ["a", "d"]


def test_a_compaction_keeps_the_live_rows_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal, "COMPACT_BYTES", 1000)
    path = tmp_path / "s.journal"
    book = Journal(path)
    live, ended = _row("t1", "a"), _row("t2", "b")
    book.begin(live)
    book.begin(ended)
    _streamed(book, live, ["Once", " more"])
    _streamed(book, ended, ["x" * 2000])
    book.end(ended)
    book.flush(lambda: [live])
    assert book.written < 1000 and os.path.getsize(path) == book.written  # the ended row's text is gone
    _streamed(book, live, ["!"])
    book.flush(lambda: [live])
    (p, text), = journal.read(path)
    assert (p.request.id, text, wire.unpack_tokens(bytes(p.generated))) == ("a", "Once more!", [100, 101, 102])


def test_a_journal_that_is_a_link_is_not_read(tmp_path: Path) -> None:
    real = tmp_path / "real.journal"
    book = Journal(real)
    book.begin(_row("t1", "a"))
    book.flush(list)
    (tmp_path / "s.journal").symlink_to(real)
    assert len(journal.read(real)) == 1 and journal.read(tmp_path / "s.journal") == []
