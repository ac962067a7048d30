"""What an instance whose server died offers the next server (READY's LIVE): the requests it holds parked, and the
answers it sent just before the death, which the dead broker may never have read (they sat in its socket, or in this
instance's queue, dropped with the link): their clients, reattaching, would otherwise find them only in the dead
server's journal and have them computed again.

    a streamed request sends a CHUNK ─▶ Said: its text and the token ids the CHUNK carried, kept while it runs
    it ends (DONE or ERROR sent) ─▶ Sent.note: its ASSIGN, its whole text and ids, its answer
    the broker's heartbeats ─▶ Sent.beat: an answer is let go at the second one after it was sent (read by then)
    the server dies ─▶ Sent.hold: the answers not let go are held from then on (a later death offers them again,
                       until HELD_S after they were sent)
    READY ─▶ live(...): each parked request (its text, the ids it generated here), then each held answer (its whole
                       text and ids: the next broker streams that text to the reattached client, and ASSIGNs it here)
    ASSIGN of a held answer's ticket ─▶ Sent.take: the answer sent again, nothing computed
    CANCEL of it (no client came) ─▶ Sent.drop
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

from mpserve.wire import protocol as wire

HELD_S = 60.0  # how long an adopting broker holds what an instance offers for its client (``adoption.HOLD_S``)


@dataclasses.dataclass
class Said:
    """What a streamed request's CHUNKs carried so far: its text, and the ids of its tokens (when reported)."""

    parts: list[str] = dataclasses.field(default_factory=list)
    ids: list[int] = dataclasses.field(default_factory=list)

    def add(self, text: str, ids: Iterable[int] = ()) -> None:
        self.parts.append(text)
        self.ids.extend(ids)

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclasses.dataclass(frozen=True)
class Held:
    """A parked sequence's request: its ASSIGN, and the ids of the tokens it generated here before it was parked."""

    assign: wire.Assign
    tokens: list[int]


@dataclasses.dataclass(frozen=True)
class Answer:
    """A request's answer as it was sent: its ASSIGN, the text and ids its CHUNKs carried, its DONE or ERROR."""

    assign: wire.Assign
    said: Said
    outcome: wire.MsgType
    body: bytes
    at: float  # monotonic: when it was sent


class Sent:
    """The answers sent lately, until their broker has surely read them, and those held since its death (until taken,
    cancelled, or HELD_S old)."""

    def __init__(self) -> None:
        self._recent: dict[str, Answer] = {}  # ticket -> its answer, sent since the broker's last heartbeat
        self._older: dict[str, Answer] = {}  # ... sent before that one, after the one before
        self._held: dict[str, Answer] = {}

    def note(self, assign: wire.Assign, said: Said | None, outcome: wire.MsgType, body: bytes) -> None:
        now = time.monotonic()
        self._recent[assign.ticket] = Answer(assign, said or Said(), outcome, body, now)
        if now - next(iter(self._recent.values())).at > HELD_S:  # no heartbeat for so long (a broker handing off)
            self._recent = {ticket: a for ticket, a in self._recent.items() if now - a.at <= HELD_S}

    def beat(self) -> None:
        """A heartbeat of the broker: the answers sent before the one it sent last are let go. The broker sends one a
        heartbeat interval apart, from the loop that reads what the workers sent, so the one before had read them."""
        self._older, self._recent = self._recent, {}

    def hold(self) -> None:
        """The server died: the answers it may not have read are held."""
        self._held |= self._older | self._recent
        self._older, self._recent = {}, {}

    def take(self, ticket: str) -> Answer | None:
        """The answer held for ``ticket``, to send again: noted as sent (the broker that asks may die before reading
        it)."""
        answer = self._held.pop(ticket, None)
        if answer is not None:
            self._recent[ticket] = answer
        return answer

    def drop(self, ticket: str) -> None:
        self._held.pop(ticket, None)

    def held(self) -> list[Answer]:
        """The answers held, those HELD_S old let go."""
        now = time.monotonic()
        self._held = {ticket: a for ticket, a in self._held.items() if now - a.at <= HELD_S}
        return list(self._held.values())


def live(parked: dict[str, Held], said: dict[str, Said], taken_over: set[str], sent: Sent) -> tuple[wire.Live, ...]:
    """READY's LIVE: each ``parked`` request whose whole text this instance streamed (one it took over from another
    instance runs again from its start), then each held answer, within one message's size."""
    offers = [wire.Live(held.assign, said[ticket].text if ticket in said else "", wire.token_frame(held.tokens))
              for ticket, held in parked.items() if ticket not in taken_over]
    offers += [wire.Live(a.assign, a.said.text, wire.token_frame(a.said.ids), answered=True) for a in sent.held()]
    out, size = [], 0
    for one in offers:
        size += len(wire.pack(one))
        if size > wire.MAX_MESSAGE_BYTES // 2:
            break
        out.append(one)
    return tuple(out)
