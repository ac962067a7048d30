"""The slot table: one writer per row, consistent reads from other processes, cleaned up by its owner."""

from __future__ import annotations

import multiprocessing
import stat
import time
from pathlib import Path

import pytest

from mpserve.errors import ConfigError
from mpserve.private import PlantedFile
from mpserve.wire import slots
from mpserve.wire.slots import SlotState, SlotTable

pytestmark = pytest.mark.timeout(30)


def _hammer(path: str, index: int, n: int) -> None:
    table = SlotTable.attach(Path(path))
    row = table.writer(index)
    for i in range(n):
        row.update(pid=i, tokens=i, served=i, request=f"r{i}", state=SlotState.BUSY)
    table.close()


def test_rows_round_trip_and_unlink_removes_the_file(tmp_path: Path) -> None:
    table = SlotTable.create(tmp_path / "s", rows=3)
    table.writer(1).update(pid=42, worker=1, slot=0, state=SlotState.IDLE, device=-1, model="tiny",
                           request="abc", tokens=7, served=2, started=1.5, load_s=0.25, kv_cells=300,
                           kv_capacity=2048)
    row = SlotTable.attach(tmp_path / "s", writable=False).read(1)
    assert (row.pid, row.state, row.model, row.request, row.tokens, row.served, row.load_s, row.kv_cells,
            row.kv_capacity) == (42, SlotState.IDLE, "tiny", "abc", 7, 2, 0.25, 300, 2048)
    table.writer(1).progress(8, 301)
    assert (table.read(1).tokens, table.read(1).kv_cells, table.read(1).kv_capacity) == (8, 301, 2048)
    assert table.read(0).state is SlotState.EMPTY
    assert [(r.index, r.pid, r.tokens) for r in SlotTable.read_rows(tmp_path / "s")] == [(0, 0, 0), (1, 42, 8),
                                                                                        (2, 0, 0)]
    table.unlink()
    assert not (tmp_path / "s").exists()


def test_readers_never_see_a_torn_row_while_another_process_writes(tmp_path: Path) -> None:
    table = SlotTable.create(tmp_path / "s", rows=1)
    table.read(0)  # read whole once: a row never read whole is taken as it is if its writer stalls mid-update
    writer = multiprocessing.get_context("spawn").Process(target=_hammer, args=(str(tmp_path / "s"), 0, 200_000))
    writer.start()
    torn = 0
    reads = 0
    while writer.is_alive() or reads == 0:
        row = table.read(0)
        reads += 1
        if not (row.pid == row.tokens == row.served and row.request in ("", f"r{row.pid}")):
            torn += 1
    writer.join()
    assert reads > 100 and torn == 0


def test_a_row_whose_writer_died_mid_update_is_read_after_a_short_wait(tmp_path: Path) -> None:
    table = SlotTable.create(tmp_path / "s", rows=1)
    table.writer(0).update(pid=7, tokens=3)
    offset = slots._HEADER.size
    (seq,) = slots._SEQ.unpack_from(table._mm, offset)
    slots._SEQ.pack_into(table._mm, offset, seq + 1)  # odd: a writer that never finished
    started = time.monotonic()
    row = table.read(0)
    assert (row.pid, row.tokens) == (7, 3) and time.monotonic() - started < slots.STUCK_WRITER_S + 1
    table.unlink()


def test_a_row_whose_writer_stalls_mid_update_is_read_as_it_was_last_read_whole(tmp_path: Path) -> None:
    table = SlotTable.create(tmp_path / "s", rows=1)
    writer = table.writer(0)
    writer.update(pid=7, tokens=3, served=3)
    reader = SlotTable.attach(tmp_path / "s", writable=False)
    assert (reader.read(0).pid, reader.read(0).tokens) == (7, 3)
    offset = slots._HEADER.size
    (seq,) = slots._SEQ.unpack_from(table._mm, offset)
    slots._SEQ.pack_into(table._mm, offset, seq + 1)  # odd: the writer stopped half way through an update
    writer._values[0] = 8
    slots._FIELDS.pack_into(table._mm, offset + slots._SEQ.size, *writer._values)  # pid written, tokens not yet
    row = reader.read(0)
    assert (row.pid, row.tokens, row.served) == (7, 3, 3)  # not (8, 3, 3): a row no writer ever wrote
    slots._SEQ.pack_into(table._mm, offset, seq + 2)  # the update finished
    assert reader.read(0).pid == 8
    reader.close()
    table.unlink()


def test_a_row_found_stuck_mid_update_says_for_how_long_and_is_not_waited_for_again(tmp_path: Path) -> None:
    table = SlotTable.create(tmp_path / "s", rows=1)
    writer = table.writer(0)
    writer.update(pid=7, tokens=3)
    reader = SlotTable.attach(tmp_path / "s", writable=False)
    assert reader.read(0).stuck_s == 0.0
    offset = slots._HEADER.size
    (seq,) = slots._SEQ.unpack_from(table._mm, offset)
    slots._SEQ.pack_into(table._mm, offset, seq + 1)  # the writer stopped half way through an update
    first = reader.read(0)  # waits for the writer, then gives up
    assert first.stuck_s >= slots.STUCK_WRITER_S and first.pid == 7
    started = time.monotonic()
    again = reader.read(0)  # the same update, found stuck before: no wait
    assert time.monotonic() - started < slots.STUCK_WRITER_S / 2 and again.stuck_s >= first.stuck_s
    slots._SEQ.pack_into(table._mm, offset, seq + 2)  # the update finished
    assert reader.read(0).stuck_s == 0.0
    slots._SEQ.pack_into(table._mm, offset, seq + 3)  # a stop in the next update: waited for afresh
    started = time.monotonic()
    assert reader.read(0).stuck_s == slots.STUCK_WRITER_S and time.monotonic() - started >= slots.STUCK_WRITER_S
    reader.close()
    table.unlink()


def test_attach_refuses_a_file_that_is_not_a_slot_table(tmp_path: Path) -> None:
    (tmp_path / "x").write_bytes(b"not a table at all, definitely not")
    with pytest.raises(ValueError, match="not a slot table"):
        SlotTable.attach(tmp_path / "x")


def test_the_table_is_made_0600_and_never_through_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "s").symlink_to(victim)  # planted at the table's name (in /dev/shm the name is predictable)
    with pytest.raises(ConfigError, match=f"the slot table {tmp_path / 's'} appeared after it was cleared"):
        SlotTable.create(tmp_path / "s", rows=1)
    assert victim.read_bytes() == b"precious"
    table = SlotTable.create(tmp_path / "t", rows=1)
    assert stat.S_IMODE((tmp_path / "t").stat().st_mode) == 0o600
    table.close()


def test_a_table_is_attached_only_as_itself_never_through_a_link(tmp_path: Path) -> None:
    """A worker (an adopted one too) writes the table it attaches: a link planted at its name is refused, and the
    file it points at is left alone."""
    table = SlotTable.create(tmp_path / "real", rows=1)
    (tmp_path / "s").symlink_to(tmp_path / "real")
    with pytest.raises(PlantedFile, match="symbolic link"):
        SlotTable.attach(tmp_path / "s")
    table.close()
