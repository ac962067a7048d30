"""SLOT_ACTION and SLOT_REPLY on the wire, and the slot ids of the slot table."""

from __future__ import annotations

import pytest

from mpserve.errors import BadRequest
from mpserve.gateway.ops import slots
from mpserve.wire import protocol as wire
from mpserve.wire.slots import CacheRow, SlotRow, SlotState, locate

pytestmark = pytest.mark.timeout(10)


def test_slot_messages_round_trip_and_bad_ones_are_refused() -> None:
    for msg in (wire.SlotAction("s1", "w0", 1, "save", "talk.bin"), wire.SlotAction("s2", "w3", 0, "erase"),
                wire.SlotReply("s1", "save", 931, 476_000, 12.5)):
        assert wire.decode(wire.encode(msg)) == msg
    for bad, problem in ((wire.SlotAction("s", "w0", 0, "load", "f"), "'action' must be one of save, restore, erase"),
                         (wire.SlotAction("s", "w0", 0, "restore"), "restore needs a 'filename'"),
                         (wire.SlotAction("s", "w0", -1, "erase"), "slot")):
        with pytest.raises(BadRequest, match=problem):
            wire.decode(wire.encode(bad))


def test_a_slot_id_is_a_slot_table_row_of_a_started_instance() -> None:
    def row(index: int, worker: int, slot: int, state: SlotState) -> SlotRow:
        return SlotRow(index, 1, worker, slot, state, -1, "tiny", "", 0, 0, 0.0, 0.0, 0.0, 0, 512, CacheRow.empty())

    rows = [row(0, 0, 0, SlotState.IDLE), row(1, 0, 1, SlotState.BUSY), row(2, 1, 0, SlotState.EMPTY)]
    assert locate(rows, 1) == ("w0", 1)
    for missing in (2, 3, -1):
        with pytest.raises(BadRequest, match=f"no slot {missing}"):
            locate(rows, missing)


def test_a_slot_id_in_a_path_is_ascii_digits_only() -> None:
    assert slots.parse("12", "save") == (12, "save")
    for bad in ("¹", "٣", "1²", "-1", "", "x", str((1 << 20) + 1)):  # str.isdigit() alone accepts the first three
        with pytest.raises(BadRequest, match="the slot id must be a slot number"):
            slots.parse(bad, "save")
