"""Preemption: which running requests give their slots to waiting ones of higher priority.

    broker dispatch: a model's queue still waits and no slot of it is free
        ──victims(waiting, running, room)──▶ the tickets to preempt ──PREEMPT, then the waiting request's ASSIGN
        into the victim's slot──▶ its worker, which parks the sequence (``BatchEngine.park``) and admits the
        waiting request in the same turn (no step between them)
    worker: the request's text so far out, its sequence parked whole ──PARKED──▶ broker
    broker: the parked request is queued again at its own priority, ahead of the requests of that priority that
        came after it, pinned to that worker
        ──a slot of that worker free again──▶ ASSIGN under its ticket ──▶ the worker resumes the sequence there
    (a victim that ended before its PREEMPT came answers DONE or ERROR as usual; its slot is the waiting one's
    all the same)

What is parked, and where: the worker keeps the sequence itself (``engine.batch._Parked``): its sampler chain,
so that a seeded sampler's random state, a grammar's state and the penalties go on where they were, its text
stream with what it holds back, and its KV cells read out of the slot into the worker's memory. Resumed, the
cells are written back as they were read and the sequence decodes the token it was about to: its text is what it
would have been without the preemption, greedy or seeded, and no token is streamed twice (the CHUNKs before
PARKED hold all it streamed; PARKED carries the ids of tokens whose text is still held back). The host store is not
used for this: it may evict an entry at any time, and with ``reuse: exact`` restores only whole prompt chunks, so a
sequence resumed from it would have to replay its tokens on a fresh sampler, which a seeded sampler's random state
does not survive. Nor are its cells copied there on the way: once parked its slot counts empty, so the admission of
the request that takes the slot spends no time keeping them (that request, ahead of every running one, then computes
its first prompt chunk alone in the next step: ``Scheduler.urgent``). The price: a parked request resumes only on its
own instance, and each instance holds at most as many parked sequences as it has slots (``room``), so the memory they
take is bounded by its KV cells'. If that instance is lost meanwhile, the request is handed over like a lost worker's
running one: resumed elsewhere from the token ids it streamed (exact for greedy output).

The rules, pure here:

- The waiting requests are taken in queue order (highest priority first). Each gets at most one victim, and the
  first that finds none ends the search (a later one has no higher priority).
- A victim runs a request of lower priority than the waiting one's: the lowest priority; of equal ones, the one that
  started last (the least work disturbed, and the longest-running requests finish).
- A request preempted MAX_PREEMPTIONS times is no longer a victim: it runs to its end, so that a stream of urgent
  requests delays it a bounded number of times. Ties go to the request started last, so the same one gives way
  each time until the bound; a preemption costs it only the wait (nothing is computed again), so the bound is
  generous.
- A worker with no ``room`` left (as many sequences parked as it has slots) gives no victim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MAX_PREEMPTIONS = 8
"""How many times one request may be preempted; after that it runs to its end."""


@dataclass(frozen=True)
class Running:
    """A running request that might give up its slot."""

    ticket: str
    priority: int
    started: float  # monotonic: when it first started (a resumed request keeps its first start)
    preemptions: int  # how many times it was preempted already
    worker: bytes


def victims(waiting: Sequence[int], running: Sequence[Running], room: Mapping[bytes, int]) -> list[str]:
    """The tickets to preempt, one for each of the first ``waiting`` requests' priorities (in queue order) that
    can have one: the i-th victim's slot goes to the i-th waiting request. ``running``: the requests of the
    model that run and are not being preempted already; ``room``: per worker, how many more sequences it may
    hold parked."""
    left = {worker: n for worker, n in room.items()}
    pool = [r for r in running if r.preemptions < MAX_PREEMPTIONS]
    chosen: list[str] = []
    for priority in waiting:
        candidates = [r for r in pool if r.priority < priority and left.get(r.worker, 0) > 0]
        if not candidates:
            break
        victim = min(candidates, key=lambda r: (r.priority, -r.started))
        chosen.append(victim.ticket)
        pool.remove(victim)
        left[victim.worker] -= 1
    return chosen
