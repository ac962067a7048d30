"""A live request taken up by another client than the one that sent it, nothing computed again: the stream of a
gateway process that died, resumed through another one (its ``Last-Event-ID``), or a client that reconnected.

    CHUNK forwarded ─▶ keep(p, body): the body kept on its row (``Pending.kept``), within KEEP_PER_REQUEST and the
                       broker's KEEP_TOTAL; past either, that row's kept text is let go (``Tables.let_go``: a
                       rebind of it is refused, and its request runs anew); let go too when it ends
    a send to a client fails (it is gone) ─▶ ``Answers.to_client``: detached (``Tables.detached``), nothing more
                       is sent to it; its requests run on for REBIND_S ─▶ expire: past it, they are cancelled
    REQUEST marked reattach, live under a gone client of the same tenant (one not known gone yet is probed: a PONG
    sent to it) with the same prompt and choices
                   ─▶ rebind: every row the new client's, each row's kept bodies sent to it first (CHUNKS: the client
                       drops the text it had, checking it), then it goes on where it runs, or waits in its queue
    ... under a client the probe finds connected (its death not yet seen by ZeroMQ, or silent) ─▶ WAIT: asked again
                       (``Clients.contested``) until it is found gone, or is silent past OWNER_SILENT_S (taken up), or
                       is heard from (alive: the request runs anew)

The kept text is bounded per request and in all; a tenant holds at most its running requests' (its limits bound
them). Rebinding asks the same tenant and the same request: a client takes over only what it could have asked for.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

from mpserve.errors import ErrorCode
from mpserve.wire import protocol as wire

from .answers import Answers
from .state import Pending
from .tables import Tables, cap_key

log = logging.getLogger("mpserve.broker")

KEEP_PER_REQUEST = 1 << 20  # bytes of chunk bodies kept per row
KEEP_TOTAL = 256 << 20  # ... and by the broker in all
REBIND_S = 10.0  # how long a gone client's requests run on, for another client to take them up
REPLAY_BATCH = 256  # kept bodies per CHUNKS sent on a rebind
OWNER_SILENT_S = 3.0  # a client with requests pending pings every second (the clients' PING_INTERVAL_S ×
# PING_LIVENESS, the silence after which they give up on the server): one silent this long is gone


class Claim(enum.Enum):
    """What became of a reattached request's claim on a live request of another client."""

    TAKEN = "taken"  # every row of it the claimant's now
    NONE = "none"  # no gone client has it: it runs anew
    WAIT = "wait"  # a client not found gone has it, and has not been heard from since the claim: ask again


def keep(tables: Tables, p: Pending, body: bytes) -> None:
    """``body`` (a CHUNK of ``p``) forwarded: kept for a rebind, if ``p`` still keeps and there is room."""
    kept = p.kept
    if kept is None:
        return
    size = len(body)
    if p.kept_bytes + size > KEEP_PER_REQUEST or tables.kept_bytes + size > KEEP_TOTAL:
        tables.let_go(p)
        return
    kept.append(body)
    p.kept_bytes += size
    tables.kept_bytes += size


class Rebinder:
    """Requests taken up by another client of their tenant; the requests of gone clients, held for it."""

    def __init__(self, tables: Tables, answers: Answers, pong: Callable[[], list[bytes]]) -> None:
        """``pong``: a PONG as the clients are sent one (to probe a client)."""
        self.tables = tables
        self.answers = answers
        self.pong = pong

    def rebind(self, client: bytes, req: wire.Request, tenant: str, since: float) -> Claim:
        """``req`` (marked reattach) from ``client``, claimed at ``since`` (monotonic): if a gone client of ``tenant``
        has it live, every choice of it is ``client``'s now, its text so far sent first. NONE: none has it (or its
        text was let go: it is cancelled there, and runs anew); WAIT: a client not found gone has it (``_live``)."""
        rows, contested = self._live(client, req, tenant, since)
        if contested:
            return Claim.WAIT
        if not rows:
            return Claim.NONE
        if req.stream and any(p.kept is None for p in rows):
            self.answers.cancel(rows[0], ErrorCode.CANCELLED, "taken up by another client, without its text")
            return Claim.NONE
        old = rows[0].client
        self.tables.unbind(old, rows[0])
        self._count(old, tenant, -len(rows))
        for p in rows:
            p.client = client
            kept = p.kept if req.stream and p.kept else []
            for at in range(0, len(kept), REPLAY_BATCH):
                self.answers.to_client(client, [wire.VERSION, wire.TYPE_FRAMES[wire.MsgType.CHUNKS],
                                                wire.splice_array(kept[at:at + REPLAY_BATCH])])
        self.tables.bind(client, rows[0])
        self._count(client, tenant, len(rows))
        self.tables.heard[client] = time.monotonic()  # its silence counts from now; it has not spoken since (``_live``)
        self.tables.stats["rebound"] += 1
        log.debug("request %s: taken up by another client of its tenant, %d bytes of text sent again", req.id,
                  sum(p.kept_bytes for p in rows))
        return Claim.TAKEN

    def _live(self, client: bytes, req: wire.Request, tenant: str, since: float) -> tuple[list[Pending], bool]:
        """The rows of the live request ``req`` names under a gone client of ``tenant``, if it is the same; and
        whether a client not found gone holds it. A client not known gone yet is sent a PONG, which finds it gone
        if ZeroMQ has seen its connection close; one it does not find gone is gone all the same once silent past
        OWNER_SILENT_S, and alive if a message of it came since the claim (being given a request is not one: a later
        claim by another socket of its client, which gave this one up, would find it alive)."""
        for owner in list(self.tables.ids.get((tenant, req.id), ())):
            p = self.tables.requests.get(self.tables.by_client.get((owner, req.id), ""))
            if owner == client or p is None or p.answered or not _same(p, req):
                continue
            if (owner in self.tables.detached or not self.answers.to_client(owner, self.pong())
                    or time.monotonic() - self.tables.heard.get(owner, 0.0) > OWNER_SILENT_S):
                return [r for r in self.tables.choices(p) if not r.answered], False
            return [], self.tables.spoke.get(owner, 0.0) < since
        return [], False

    def _count(self, client: bytes, tenant: str, n: int) -> None:
        """``client``'s pending counts, by ``n``."""
        capped = cap_key(client, tenant)
        for counts, key in ((self.tables.owned, client), (self.tables.capped, capped)):
            left = counts.get(key, 0) + n
            if left > 0:
                counts[key] = left
            else:
                counts.pop(key, None)
        if client not in self.tables.owned:
            self.tables.heard.pop(client, None)
            self.tables.spoke.pop(client, None)
            self.tables.detached.pop(client, None)

    def expire(self, now: float) -> None:
        """The requests of the clients gone for REBIND_S that no client took up: cancelled."""
        for client, since in list(self.tables.detached.items()):
            if now - since > REBIND_S or client not in self.tables.owned:
                self.answers.drop_client(client)  # nothing is sent to it: it is still detached
                self.tables.detached.pop(client, None)


def _same(p: Pending, req: wire.Request) -> bool:
    """Whether ``req`` asks what the request ``p`` is the first row of asks: the same prompt, choices and stream."""
    held = p.request
    return (held.prompt, held.tokens, held.images, held.cache_salt, held.stream, len(p.group) or 1) == (
        req.prompt, req.tokens, req.images, req.cache_salt, req.stream, req.params.n)
