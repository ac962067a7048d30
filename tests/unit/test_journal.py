"""The journal of resumable streams (``mpserve.gateway.api.journal``) on its own, on a SQLite file: a gateway that
stops ends its streams as cancelled (their readers told so), and a stream whose gateway process died shows so."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest

from mpserve.errors import MpserveError
from mpserve.gateway.api import journal as journal_module
from mpserve.gateway.api.journal import Journal
from mpserve.gateway.api.response_store import NotStored, ResponseStore

pytestmark = pytest.mark.timeout(30)


async def _endless() -> AsyncGenerator[bytes, None]:
    n = 0
    while True:
        yield b"data: %d\n\n" % n
        n += 1
        await asyncio.sleep(0.01)


def _error(exc: MpserveError, seq: int) -> bytes:
    return b"data: error %s\n\n" % exc.code.value.encode()


def test_a_gateway_that_stops_ends_its_streams_as_cancelled(tmp_path: Path) -> None:
    async def run() -> list[bytes]:
        journal = Journal(tmp_path / "j.sqlite")
        journal.begin("o", "k", "digest")
        journal.produce("o", "k", _endless())
        while journal._db.execute("SELECT count(*) FROM events").fetchone()[0] < 4:  # the tail below reads from 3
            await asyncio.sleep(0.01)
        await journal.close()  # cancels the producer: its generator closed, its end written
        again = Journal(tmp_path / "j.sqlite")
        assert again.stream("o", "k").state == "cancelled"
        frames = [frame async for frame in again.tail("o", "k", 2, _error)]
        await again.close()
        return frames

    frames = asyncio.run(run())
    assert frames[0].startswith(b"id: 3\ndata: 3") and frames[-1] == b"data: error cancelled\n\n"


def test_a_stream_nobody_reads_is_stopped_after_the_grace_even_when_its_generation_stalls(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_module, "GRACE_S", 0.3)
    monkeypatch.setattr(journal_module, "SEEN_EVERY_S", 0.05)
    closed = asyncio.Event()

    async def stalled() -> AsyncGenerator[bytes, None]:  # one batch, then nothing (its tokens held up somewhere)
        try:
            yield b"data: 0\n\n"
            await asyncio.Event().wait()
        finally:
            closed.set()  # where the generation is cancelled

    async def run() -> str:
        journal = Journal(tmp_path / "j.sqlite")
        journal.begin("o", "k", "digest")
        journal.produce("o", "k", stalled())
        await asyncio.wait_for(closed.wait(), 10)
        while journal.stream("o", "k").state == "running":
            await asyncio.sleep(0.01)
        state = journal.stream("o", "k").state
        await journal.close()
        return state

    assert asyncio.run(run()) == "cancelled"


@pytest.mark.parametrize("turns", range(12))
def test_a_reader_stopped_as_new_events_ring_it_stops(tmp_path: Path, turns: int) -> None:
    """The HTTP answer of a client that hung up cancels its reader; the reader must not take the producer's bell,
    rung in the same loop turns, for an answer and read on (it would mark the stream as read for ever)."""
    async def run() -> bool:
        gate = asyncio.Event()

        async def on_the_gate() -> AsyncGenerator[bytes, None]:  # a batch each time the gate opens
            n = 0
            while True:
                await gate.wait()
                gate.clear()
                yield b"data: %d\n\n" % n
                n += 1

        journal = Journal(tmp_path / "j.sqlite")
        journal.begin("o", "k", "digest")
        journal.produce("o", "k", on_the_gate())

        async def read() -> None:
            async for _ in journal.tail("o", "k", -1, _error):
                pass

        reader = asyncio.create_task(read())
        while not journal._wake["o", "k"]._waiters:  # the reader waits on the bell
            await asyncio.sleep(0.001)
        gate.set()  # a batch: the producer writes it and rings the bell
        for _ in range(turns):
            await asyncio.sleep(0)  # not a wait: loop turns, counted
        reader.cancel()
        await asyncio.wait((reader,), timeout=5)
        stopped = reader.cancelled()
        if not stopped:
            reader.cancel()
        await journal.close()
        return stopped

    assert asyncio.run(run())


def test_a_stream_whose_gateway_process_died_is_orphaned(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    pid = int(dead.stdout)

    async def run() -> None:
        journal = Journal(tmp_path / "j.sqlite")
        journal.begin("o", "k", "digest", b"{}")
        journal._db.execute("UPDATE streams SET pid = ? WHERE key = 'k'", (pid,))  # as a process that died wrote it
        assert journal.stream("o", "k").state == "orphaned"
        frames = [frame async for frame in journal.tail("o", "k", -1, _error)]
        assert frames == [b"data: error connection\n\n"]
        await journal.close()

    asyncio.run(run())


def _dead_pid() -> int:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    return int(dead.stdout)


def test_a_stream_whose_gateway_process_died_is_taken_over_once_with_the_pieces_its_events_were_made_of(
        tmp_path: Path) -> None:
    pid = _dead_pid()

    async def batches(fed: list[tuple[int, str]]) -> AsyncGenerator[bytes, None]:
        for pieces, events in (([(0, "Hel"), (0, "lo")], b"data: a\n\ndata: b\n\n"), ([(1, " you")], b"data: c\n\n")):
            fed.extend(pieces)
            yield events
        journaled.set()  # asked for more: both batches are written
        await asyncio.sleep(30)  # not a wait: still running when its process "dies"

    journaled = asyncio.Event()

    async def run() -> None:
        journal = Journal(tmp_path / "j.sqlite")
        journal.begin("o", "k", "digest")
        fed: list[tuple[int, str]] = []
        journal.produce("o", "k", batches(fed), fed=fed)
        await asyncio.wait_for(journaled.wait(), 10)
        journal._db.execute("UPDATE streams SET pid = ? WHERE key = 'k'", (pid,))  # as a process that died wrote it
        assert journal.stream("o", "k").state == "orphaned"
        taken = journal.take_over("o", "k")
        assert taken is not None and taken.next_seq == 3 and taken.pieces == [(0, "Hel"), (0, "lo"), (1, " you")]
        assert journal.stream("o", "k").state == "running" and journal.take_over("o", "k") is None  # ours now

        journal.begin("o", "bg", "bg", b"{}")  # a background response without its request: none to send again
        journal._db.execute("UPDATE streams SET pid = ? WHERE key = 'bg'", (pid,))
        assert journal.take_over("o", "bg") is None
        journal.begin("o", "bg2", "bg2", b'{"id": "bg2"}', b'{"body": {}}')  # one with it
        journal._db.execute("UPDATE streams SET pid = ? WHERE key = 'bg2'", (pid,))
        again = journal.take_over("o", "bg2")
        assert again is not None and (again.head, again.request, again.next_seq) == (b'{"id": "bg2"}',
                                                                                    b'{"body": {}}', 0)
        await journal.close()

    asyncio.run(run())


def test_a_deleted_background_response_leaves_nothing_and_its_producer_elsewhere_writes_nothing_more(
        tmp_path: Path) -> None:
    """``delete`` in the producing process stops the producer at once; a delete by another process (its row gone,
    this process's producer not told) stops it at its next batch, which is not written. Neither leaves a row, and
    a put of the deleted response's id is refused in the store (it could end meanwhile)."""
    def rows(journal: Journal, key: str) -> int:
        return sum(journal._db.execute(f"SELECT count(*) FROM {table} WHERE key = ?", (key,)).fetchone()[0]  # noqa: S608
                   for table in ("streams", "events", "asked", "fed"))

    async def run() -> None:
        journal, store = Journal(tmp_path / "j.sqlite"), ResponseStore(tmp_path / "j.sqlite")
        for key in ("here", "elsewhere"):
            journal.begin("o", key, key, b'{"id": "%s"}' % key.encode(), b'{"body": {}}')
            journal.produce("o", key, _endless(), background=True)
        while rows(journal, "here") < 4 or rows(journal, "elsewhere") < 4:
            await asyncio.sleep(0.01)  # not a wait: the producers are writing
        assert journal.delete("o", "here") and rows(journal, "here") == 0
        with journal._lock:  # as another gateway process's delete: the row goes, nobody here is told
            for table in ("streams", "events", "asked", "fed"):
                journal._db.execute(f"DELETE FROM {table} WHERE key = 'elsewhere'")  # noqa: S608
        while journal._tasks:
            await asyncio.sleep(0.01)  # not a wait: both producers end
        assert rows(journal, "here") == rows(journal, "elsewhere") == 0
        assert not journal.delete("o", "here")
        store.delete("o", "here", journaled=True)
        store.put("o", {"id": "here"}, [])  # the response ending after its delete
        with pytest.raises(NotStored):
            store.get("o", "here")
        await journal.close()
        store.close()

    asyncio.run(run())
