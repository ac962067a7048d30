"""What a client keeps of each completion it sent, for a reattach (``mpserve.client``): the request, the server start
it went to, whether an answer of it came since, and each choice's text delivered, so that the text a server streams
again after a reattach is dropped where it was delivered already, and checked equal:

    CHUNK ─▶ fresh(index, text): the part past what this choice delivered (all of it when nothing is replayed)
    reattached(): sent again ─▶ the text delivered is to come again first, before anything new
    resumed(delivered): sent by another client than the one that delivered ``delivered``
"""

from __future__ import annotations

from collections.abc import Mapping

from mpserve.errors import ConnectionFailed
from mpserve.wire import protocol as wire


class Track:
    """A completion sent and not answered yet, as a reattach needs it: the request, and each choice's text delivered
    so far; while it is streamed again after a reattach, how far the new text has matched it (``_replay``)."""

    __slots__ = ("request", "server", "heard", "_pieces", "_replay")

    def __init__(self, request: wire.Request, server: str) -> None:
        self.request = request
        self.server: str | None = server  # the start of the server it was last sent to (its PONGs name it); None:
        # sent again on a new connection, to whichever start answers there next
        self.heard = False  # whether an answer of it came since it was last sent
        self._pieces: dict[int, list[str]] = {}  # choice -> the text delivered, piece by piece
        self._replay: dict[int, tuple[str, int]] = {}  # choice -> its text delivered, and how much of it came again

    def reattached(self) -> None:
        self.heard = False
        self._replay = {index: ("".join(pieces), 0) for index, pieces in self._pieces.items() if pieces}

    def resumed(self, delivered: Mapping[int, str]) -> None:
        """Sent again by another client than the one that delivered ``delivered`` (each choice's text so far)."""
        self._pieces = {index: [text] for index, text in delivered.items() if text}
        self.reattached()

    def fresh(self, index: int, text: str) -> str:
        """The part of ``text`` (the next chunk of choice ``index``) not delivered already; raises
        ConnectionFailed if what came again differs from what was delivered."""
        pieces = self._pieces.setdefault(index, [])
        if index not in self._replay:
            pieces.append(text)
            return text
        seen, at = self._replay[index]
        again = seen[at:at + len(text)]
        if not text.startswith(again):
            raise ConnectionFailed(f"request {self.request.id}: after the server came back it ran again, and its "
                                   "text differs from what was streamed before (a sampled request needs a seed to "
                                   "repeat); its stream ends here")
        at += len(again)
        if at >= len(seen):
            del self._replay[index]
        else:
            self._replay[index] = (seen, at)
        new = text[len(again):]
        if new:
            pieces.append(new)
        return new
