"""What a worker's turn gathered for the broker (its CHUNK, DONE and ERROR messages), sent as one message:

    Worker._queue ──add──▶ Outbox (within the size one message may have: ``fits``) ──take──▶ one message as
    itself, or several as one STEP (``wire.encode_step``) ──▶ Worker._flush sends it
"""

from __future__ import annotations

from mpserve.wire import protocol as wire


class Outbox:
    """The CHUNK, DONE and ERROR messages gathered for one send, within the size one message may have."""

    __slots__ = ("_entries", "_bytes")

    def __init__(self) -> None:
        self._entries: list[tuple[wire.MsgType, str, bytes, bytes | None]] = []
        self._bytes = 0

    def fits(self, body: bytes, trailer: bytes | None) -> bool:
        return not self._entries or self._bytes + _size(body, trailer) <= wire.MAX_MESSAGE_BYTES

    def add(self, mtype: wire.MsgType, ticket: str, body: bytes, trailer: bytes | None) -> None:
        self._entries.append((mtype, ticket, body, trailer))
        self._bytes += _size(body, trailer)

    def take(self) -> list[bytes] | None:
        """The frames of what was gathered (None if nothing), and the box empty again."""
        entries = self._entries
        if not entries:
            return None
        self._entries, self._bytes = [], 0
        if len(entries) > 1:
            return wire.encode_step(entries)
        return wire.worker_frames(*entries[0])


def _size(body: bytes, trailer: bytes | None) -> int:
    return len(body) + (len(trailer) if trailer is not None else 0) + 96  # with the entry's own framing
