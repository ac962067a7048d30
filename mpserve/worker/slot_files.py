"""SLOT_ACTION: save an idle slot's KV cells to a file in the model's ``slot_save_path``, restore them from
one, or erase them; answered between steps.

    broker --SLOT_ACTION--> answer(engine, folder, action) --SLOT_REPLY or ERROR--> broker --> client

A file name is a plain name inside the folder (no separators, no leading dot), as llama-server takes it.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from mpserve.engine.interface import Engine
from mpserve.errors import BadRequest, ErrorCode, MpserveError
from mpserve.wire import protocol as wire

FILENAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def answer(engine: Engine | None, folder: str | None, msg: wire.SlotAction) -> wire.SlotReply | wire.Error:
    if engine is None:
        return wire.Error(msg.id, ErrorCode.BUSY, "the model is not loaded here now; retry")
    started = time.perf_counter()
    try:
        size = 0
        if msg.action == "erase":
            tokens = engine.erase_slot(msg.slot)
        elif msg.action == "save":
            path = _path(folder, msg.filename)
            tokens = engine.save_slot(msg.slot, path)
            size = path.stat().st_size
        else:
            path = _path(folder, msg.filename)
            tokens = engine.restore_slot(msg.slot, path)
            size = path.stat().st_size
    except MpserveError as exc:
        return wire.Error(msg.id, exc.code, exc.message)
    return wire.SlotReply(msg.id, msg.action, tokens, size, (time.perf_counter() - started) * 1000)


def _path(folder: str | None, filename: str) -> Path:
    if folder is None:
        raise BadRequest("slot save and restore are off for this model; give it a slot_save_path (a folder)")
    if not FILENAME.fullmatch(filename):
        raise BadRequest(f"file name {filename!r} is not allowed: letters, digits, '.', '_' and '-', starting "
                         "with a letter or digit, at most 128 characters")
    return Path(folder) / filename
