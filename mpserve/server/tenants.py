"""Per tenant: the order in which a model's queued requests start (``FairQueue``), and each tenant's limits and
figures (``Ledger``). Pure: the broker calls them with its tickets, tenants and clock.

A model's queue, in the order its requests start:

    by ``priority`` band, highest first        (a tenant's priority is capped by its ``max_priority``)
        within a band, first the requests put back (they had started: their worker was lost, or they were
        preempted), in the order they came back; then weighted fair queuing: each tenant's requests in order of
        arrival; the next tenant is the one whose virtual finish time is least (start-time fair queuing: a
        tenant's next request starts at the virtual finish of what it was given so far), where
            a tenant's finish = moved up to the queue's virtual clock when it begins to wait; then, at each
                                dispatch, + cost / weight
            cost              = the model's mean slot time per request × slots (n choices: n)
        A dispatch moves the clock to the finish the tenant had. When the request ends, its tenant's finish
        moves by (slot time used − cost) / weight: shares are of slot time, not of requests, and a cost guessed
        wrong is set right before it weighs on the order.
        A tenant that waited for nothing starts from the clock: an idle tenant's share goes to the others, and
        it saves up no credit for later.
    a tenant at its ``max_running`` is passed over (the next eligible one goes first), its requests keep their
    places

So with tenants of weights 1 and 2 both waiting, the second gets twice the slot time; with one alone waiting,
it gets every slot.

The ``Ledger`` counts per tenant what is running, the tokens of the last minute (prompt and generated tokens of
the requests that ended, each counted when its DONE came), and the figures (``wire.TenantStats``); it refuses a
request over a limit with ``Busy`` naming the limit, its value and the tenant's use. Without a ``tenants`` section
a keyed tenant's priority is capped all the same (``KEYED``), with a warning the first time each one asks for
more.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

from mpserve.config.tenants import KEYED, LOCAL, UNCAPPED, Tenant, Tenants
from mpserve.counts import counted
from mpserve.errors import Busy
from mpserve.wire import protocol as wire

log = logging.getLogger(__name__)

WINDOW_S = 60.0  # tokens_per_minute's window
TOP_TENANTS = 16  # tenants shown by name in the figures; the rest are summed as OTHER
OTHER = "other"


def shown(tenant: str) -> str:
    """How a tenant is named in messages and figures."""
    return "local" if tenant == LOCAL else tenant


@dataclass(slots=True)
class _Queued:
    tenant: str
    priority: int
    cost: float  # estimated slot-seconds
    seq: int  # arrival order, for ties
    back: bool  # put back (``requeue``): first in its band, not charged again


class FairQueue:
    """One model's queued tickets (see the module's docstring). Iterating gives every ticket, in no set order."""

    def __init__(self, weight: Callable[[str], float] = lambda tenant: 1.0) -> None:
        self._weight = weight
        self._weights: dict[str, float] = {}  # tenant -> its weight, taken when it begins to wait
        self._entries: dict[str, _Queued] = {}
        self._front: dict[int, deque[str]] = {}  # priority -> tickets put back, first in their band
        self._bands: dict[int, dict[str, deque[str]]] = {}  # priority -> tenant -> its tickets, in arrival order
        self._finish: dict[str, float] = {}  # tenant -> virtual finish of its last dispatched request
        self._clock = 0.0
        self._seq = itertools.count()
        self._waiting: dict[str, int] = {}  # tenant -> tickets queued

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __contains__(self, ticket: object) -> bool:
        return ticket in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def waiting(self, tenant: str) -> int:
        return self._waiting.get(tenant, 0)

    def append(self, ticket: str, tenant: str = LOCAL, priority: int = 0, cost: float = 1.0) -> None:
        """Queue ``ticket`` behind its tenant's others of its priority."""
        self._add(ticket, tenant, priority, cost, False)
        self._bands.setdefault(priority, {}).setdefault(tenant, deque()).append(ticket)

    def requeue(self, ticket: str, tenant: str = LOCAL, priority: int = 0, cost: float = 1.0) -> None:
        """Queue ``ticket`` first in its band (behind those put back before it): it had started, and lost its
        slot. Not charged again when it starts."""
        self._add(ticket, tenant, priority, cost, True)
        self._front.setdefault(priority, deque()).append(ticket)

    def above(self, floor: int) -> list[str]:
        """The tickets of a priority above ``floor``, highest first; of one priority, those put back first, then by
        arrival."""
        if max(self._bands.keys() | self._front.keys(), default=floor) <= floor:  # the common case: none
            return []
        found = [(t, e) for t, e in self._entries.items() if e.priority > floor]
        return [t for t, _ in sorted(found, key=lambda te: (-te[1].priority, not te[1].back, te[1].seq))]

    def line(self, tenant: str, priority: int) -> Sequence[str]:
        """``tenant``'s tickets of ``priority`` in arrival order (those put back are not in it)."""
        return self._bands.get(priority, {}).get(tenant, ())

    def oldest(self) -> str:
        """The ticket queued longest ago (put back: when it came back)."""
        return next(iter(self._entries))

    def _add(self, ticket: str, tenant: str, priority: int, cost: float, back: bool) -> None:
        self._entries[ticket] = _Queued(tenant, priority, cost, next(self._seq), back)
        waiting = self._waiting.get(tenant, 0)
        if not waiting:  # it begins to wait: from now, not from when it was last served
            self._finish[tenant] = max(self._finish.get(tenant, 0.0), self._clock)
            self._weights[tenant] = self._weight(tenant)
        self._waiting[tenant] = waiting + 1

    def remove(self, ticket: str) -> None:
        """Take ``ticket`` out (cancelled, timed out, refused); not charged."""
        entry = self._entries.pop(ticket)
        tenant, priority = entry.tenant, entry.priority
        left = self._waiting[tenant] - 1
        if left:
            self._waiting[tenant] = left
        else:
            del self._waiting[tenant]
        if entry.back:
            if _emptied(self._front[priority], ticket):
                del self._front[priority]
            return
        band = self._bands[priority]
        if _emptied(band[tenant], ticket):
            del band[tenant]
            if not band:
                del self._bands[priority]

    def head(self, eligible: Callable[[str], bool] | None = None, passed: Collection[str] = ()) -> str | None:
        """The ticket that starts next: the highest band's first put back (but those ``passed``: put back after a
        preemption, their instance has no slot free), else its tenants' by least virtual finish among those
        ``eligible`` says may start one more (None: any may); None if none may."""
        bands = self._bands
        if not self._front and len(bands) == 1:  # the common case: one band
            band = next(iter(bands.values()))
            if len(band) == 1 and eligible is None:  # and one tenant waits in it
                return next(iter(band.values()))[0]
        for priority in sorted(bands.keys() | self._front.keys(), reverse=True):
            front = next((t for t in self._front.get(priority, ()) if t not in passed), None)
            if front is not None:
                return front
            if priority not in bands:
                continue
            band = bands[priority]
            if len(band) == 1:  # one tenant waits in this band
                tenant, line = next(iter(band.items()))
                if eligible is None or eligible(tenant):
                    return line[0]
                continue
            best: tuple[float, int, str] | None = None
            for tenant, line in band.items():
                if eligible is not None and not eligible(tenant):
                    continue
                key = (self._finish[tenant], self._entries[line[0]].seq, line[0])
                if best is None or key < best:
                    best = key
            if best is not None:
                return best[2]
        return None

    def pop(self, ticket: str) -> None:
        """``ticket`` (the head) starts: its tenant's finish advances by its cost, the clock to its start."""
        entry = self._entries[ticket]
        if not entry.back:
            tenant = entry.tenant
            start = self._finish[tenant]
            if start > self._clock:
                self._clock = start
            self._finish[tenant] = start + entry.cost / self._weights[tenant]
        self.remove(ticket)
        if len(self._finish) > 2 * len(self._waiting) + 64:
            self._forget_idle()

    def charge(self, tenant: str, seconds: float) -> None:
        """A request of ``tenant`` ended: it used ``seconds`` more slot time than its cost said (less if
        negative)."""
        if tenant in self._finish:
            self._finish[tenant] += seconds / self._weights[tenant]

    def _forget_idle(self) -> None:
        """Forget the finish of tenants that wait for nothing and whose finish the clock has passed: they start from
        the clock when they wait again anyway."""
        self._finish = {t: f for t, f in self._finish.items() if f > self._clock or t in self._waiting}
        self._weights = {t: w for t, w in self._weights.items() if t in self._finish}


def _emptied(line: deque[str], ticket: str) -> bool:
    """Take ``ticket`` out of ``line``; whether that emptied it."""
    if line[0] == ticket:  # the head, which starts
        line.popleft()
    else:
        line.remove(ticket)
    return not line


@dataclass
class _Account:
    running: int = 0
    window: deque[tuple[float, int]] = field(default_factory=deque)  # (when, tokens) of the last WINDOW_S
    in_window: int = 0
    figures: wire.TenantStats = field(default_factory=wire.TenantStats)


class Ledger:
    """Every tenant's running requests, tokens of the last minute, and figures; the limits checked against them."""

    def __init__(self, tenants: Tenants | None) -> None:
        self._accounts: dict[str, _Account] = {}
        self._warned: set[str] = set()  # keyed tenants told that their priority was capped without a section
        self.configure(tenants)

    def configure(self, tenants: Tenants | None) -> None:
        """Take the ``tenants`` section (at start, or a new one): weights apply to tenants as they begin to wait,
        ceilings and limits to the next request."""
        self.tenants = tenants
        capped = tenants is not None and any(
            s.max_running is not None for s in (tenants.default, *tenants.declared.values()))
        # what ``FairQueue.head`` asks whether a tenant may start one more; None: no tenant has a max_running
        self.eligible: Callable[[str], bool] | None = self.may_start if capped else None

    def settings(self, tenant: str) -> Tenant:
        if self.tenants is not None:
            return self.tenants.of(tenant)
        return UNCAPPED if tenant == LOCAL else KEYED

    def priority(self, tenant: str, asked: int) -> int:
        """``asked``, capped by the tenant's ceiling."""
        ceiling = self.settings(tenant).max_priority
        if asked > ceiling and self.tenants is None and tenant not in self._warned:
            self._warned.add(tenant)
            log.warning("tenant %s asked for priority %d, lowered to %d: without a tenants section a tenant other "
                        "than the local one may ask for %d at most; declare its max_priority in the tenants section "
                        "to allow more", shown(tenant), asked, ceiling, ceiling)
        return min(asked, ceiling)

    def weight(self, tenant: str) -> float:
        return self.settings(tenant).weight

    def _account(self, tenant: str) -> _Account:
        account = self._accounts.get(tenant)
        if account is None:
            account = self._accounts[tenant] = _Account()
        return account

    def limited(self, tenant: str) -> bool:
        """Whether ``tenant`` has a limit ``admit`` checks."""
        settings = self.settings(tenant)
        return settings.max_queued is not None or settings.tokens_per_minute is not None

    def running(self, tenant: str) -> int:
        account = self._accounts.get(tenant)
        return account.running if account is not None else 0

    def may_start(self, tenant: str, slots: int = 1) -> bool:
        """Whether ``tenant`` may start ``slots`` more requests under its max_running."""
        limit = self.settings(tenant).max_running
        return limit is None or self.running(tenant) + slots <= limit or self.running(tenant) == 0

    def admit(self, tenant: str, waiting: int, would_wait: bool, now: float) -> None:
        """Refuse a new request over one of ``tenant``'s limits (``Busy``, naming it); ``waiting``: its requests
        queued now, ``would_wait``: whether this one would wait too."""
        settings = self.settings(tenant)
        who = f"tenant {shown(tenant)}"
        queued = waiting + would_wait
        if settings.max_queued is not None and queued > settings.max_queued:
            running = self.running(tenant)
            of_running = f", its max_running {settings.max_running}" if settings.max_running is not None else ""
            self._refused(tenant)
            raise Busy(f"{who} has {counted(waiting, 'request')} queued, its max_queued ({settings.max_queued}), "
                       f"and {running} running{of_running}; retry once some have finished", retry_after=1.0)
        limit = settings.tokens_per_minute
        if limit is not None:
            account = self._account(tenant)
            self._slide(account, now)
            if account.in_window >= limit:
                self._refused(tenant)
                raise Busy(f"{who} has used {account.in_window} tokens (prompt and generated) in the last "
                           f"{WINDOW_S:.0f} s, its tokens_per_minute ({limit}); retry when older ones leave the window",
                           retry_after=self._window_frees(account, limit, now))

    def _refused(self, tenant: str) -> None:
        self._account(tenant).figures.refusals += 1

    @staticmethod
    def _slide(account: _Account, now: float) -> None:
        while account.window and account.window[0][0] <= now - WINDOW_S:
            account.in_window -= account.window.popleft()[1]

    @staticmethod
    def _window_frees(account: _Account, limit: int, now: float) -> float:
        """Seconds until the tokens in the window drop below ``limit``."""
        left = account.in_window
        for when, tokens in account.window:
            left -= tokens
            if left < limit:
                return round(max(0.1, when + WINDOW_S - now), 2)
        return 0.1

    def accepted(self, tenant: str) -> None:
        self._account(tenant).figures.requests += 1

    def started(self, tenant: str, queued_s: float) -> None:
        account = self._account(tenant)
        account.running += 1
        account.figures.queue_s += queued_s

    def stopped(self, tenant: str) -> None:
        """A request of ``tenant`` left its slot (ended, or its worker was lost)."""
        account = self._account(tenant)
        account.running = max(0, account.running - 1)

    def used(self, tenant: str, prompt_tokens: int, generated_tokens: int, now: float) -> None:
        """A request of ``tenant`` ended with these tokens: counted in its figures and its window."""
        account = self._account(tenant)
        account.figures.prompt_tokens += prompt_tokens
        account.figures.generated_tokens += generated_tokens
        if self.settings(tenant).tokens_per_minute is not None:
            self._slide(account, now)
            account.window.append((now, prompt_tokens + generated_tokens))
            account.in_window += prompt_tokens + generated_tokens

    def preempted(self, tenant: str) -> None:
        """A running request of ``tenant`` was preempted for one of higher priority."""
        self._account(tenant).figures.preemptions += 1

    def figures(self, queued: Callable[[str], int]) -> dict[str, wire.TenantStats]:
        """The TOP_TENANTS tenants with the most requests by name, the others summed as OTHER; ``queued``: a
        tenant's requests waiting now."""
        rows = {tenant: _with_now(a, queued(tenant)) for tenant, a in self._accounts.items()}
        ranked = sorted(rows, key=lambda t: (-rows[t].requests, t))
        shown_rows = {shown(t): rows[t] for t in ranked[:TOP_TENANTS]}
        rest = [rows[t] for t in ranked[TOP_TENANTS:]]
        if rest:
            shown_rows[OTHER] = wire.TenantStats(*(sum(getattr(r, f.name) for r in rest)
                                                   for f in dataclasses.fields(wire.TenantStats)))
        return shown_rows


    def own_figures(self, tenant: str, queued: Callable[[str], int]) -> dict[str, wire.TenantStats]:
        """``figures`` as a keyed client may read them: its own tenant's row alone (none before its first
        request)."""
        account = self._accounts.get(tenant)
        return {shown(tenant): _with_now(account, queued(tenant))} if account is not None else {}


def _with_now(account: _Account, queued: int) -> wire.TenantStats:
    f = account.figures
    return wire.TenantStats(f.requests, f.prompt_tokens, f.generated_tokens, round(f.queue_s, 3), f.refusals,
                            f.preemptions, account.running, queued)
