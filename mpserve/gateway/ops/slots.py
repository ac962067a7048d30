"""llama-server's ``POST /slots/{id}?action=save|restore|erase`` shapes: the call in, ``AsyncClient.slot``'s
arguments out, and its answer back in that shape. No I/O here.

    POST /slots/ID?action=save     {"filename": str} -> {"id_slot", "filename", "n_saved", "n_written",
                                                         "timings": {"save_ms"}}
    POST /slots/ID?action=restore  {"filename": str} -> {"id_slot", "filename", "n_restored", "n_read",
                                                         "timings": {"restore_ms"}}
    POST /slots/ID?action=erase                      -> {"id_slot", "n_erased"}

ID is SLOT in ``mpserve status``: a row of the slot table, so this needs the server on this host.
"""

from __future__ import annotations

from typing import Any

from mpserve.errors import BadRequest
from mpserve.wire import protocol as wire


def parse(slot: str, action: str | None) -> tuple[int, str]:
    if not (slot.isascii() and slot.isdigit()) or int(slot) > 1 << 20:
        raise BadRequest(f"the slot id must be a slot number (SLOT in mpserve status), got {slot!r}")
    if action not in wire.SLOT_ACTIONS:
        raise BadRequest(f"'action' must be one of {', '.join(wire.SLOT_ACTIONS)}, got {action!r}")
    return int(slot), action


def filename(body: Any) -> str:
    name = body.get("filename") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name or len(name) > wire.MAX_FILENAME_CHARS:
        raise BadRequest(f"the body must be {{\"filename\": a name of at most {wire.MAX_FILENAME_CHARS} characters}}")
    return name


def answer(slot: int, name: str, reply: wire.SlotReply) -> dict[str, Any]:
    if reply.action == "erase":
        return {"id_slot": slot, "n_erased": reply.tokens}
    saved = reply.action == "save"
    return {"id_slot": slot, "filename": name, "n_saved" if saved else "n_restored": reply.tokens,
            "n_written" if saved else "n_read": reply.bytes,
            "timings": {"save_ms" if saved else "restore_ms": reply.ms}}
