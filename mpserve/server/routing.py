"""The broker's decisions, as pure functions over its tables: which free slot a request goes to, and what
becomes of a request whose worker died.

    choose_slot(free slots, workers, prompt,   the longest cached prefix, held in KV cells (the slot's own
                blocks, salt)                  first, then another slot's of its instance) or in its
                                               host's store (``blocks``: the prompt's block hashes, matched
                                               against ``WorkerEntry.ram``, one view per host: every
                                               instance there can restore it, so the least busy one takes it)
                                               > the instance's adapter sets (``affinity``): running
                                               the request's set alone, then idle, then running others
                                               > least busy instance > free the longest. A slot's last
                                               prompt counts only under the request's salt (and the block
                                               hashes are keyed with it): what one tenant's prompts left
                                               never draws another tenant's (``mpserve.wire.salt``)
    affinity(request's set, sets running)      how cheaply an instance takes a request's LoRA adapters
    pick_queued(window, sets run alone)        which queued request goes next: the oldest, or a younger one
                                               that an instance with a free slot can batch with its own
                                               set (the oldest passed over at most MAX_PASSED times)
    stranded(names, instances' adapters,       whether a request for LoRA adapters no instance has, loads or
             starting)                         will be sent (none starting) can never start
    choose_slots(…, n)                         n free slots of one instance (a request for n choices), and
                                               why (``Source``: the broker counts its routes by it)
    crash_signal(exit code)                    the signal of a local worker's death, if it is one a request
                                               can cause (CRASH_SIGNALS); None: killed from outside or exited
    crash_streak(model, tickets)               the model's crash streak once a worker crashed running
                                               ``tickets``: one more if one of them is new to the streak
    after_loss(request)                        RETRY (nothing streamed yet, or the tokens streamed are
                                               known: resumed from them) | LOST (text streamed, its
                                               tokens unknown) | POISON (it has now crashed MAX_CRASHES
                                               workers) | BOUND (it has now lost MAX_HANDOVERS workers to
                                               causes not its own)

A request's worker ends in one of two ways, and they are counted apart in its row (``Pending``):

    crash     a local worker died of a crash signal while the request ran, or the busy watchdog stopped it
    (crashes)   (a request can hang an engine as well as crash it): the request may be the cause
    hand-over anything else: a local worker killed from outside (SIGKILL, SIGTERM: an operator, the OOM
    (handovers) killer), one that exited with a code, a remote worker that went silent or whose pool died:
                the request is not the cause, and goes on elsewhere as it would after a crash, uncounted
                as one

A model's crashes are counted too (``ModelQueue.crash_streak``, by the broker): MODEL_CRASHES crashes in a
row, each on a request that had not crashed yet in the streak, fail the model as a whole. MODEL_CRASHES
is above MAX_CRASHES, so no one request (which crashes at most MAX_CRASHES workers, then is poison) can
fail its model; counting one per crash, not each request a batch held, keeps one poison request in a
batching instance from failing it either.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from signal import Signals

from mpserve.wire.prefix import common_prefix

from .state import ModelQueue, Pending, RequestState, WorkerEntry

MAX_CRASHES = 2  # workers a request may crash (or stall) before it is poison
MAX_HANDOVERS = 8  # workers a request may lose to causes not its own before it is answered worker_lost
MODEL_CRASHES = 3  # crashes in a row on different requests that fail the model
CRASH_SIGNALS = frozenset({Signals.SIGSEGV, Signals.SIGBUS, Signals.SIGFPE, Signals.SIGILL, Signals.SIGABRT})
MIN_SHARED_PREFIX = 32  # characters a prompt must share with a slot's last one to be routed to it
MAX_PASSED = 4  # times the oldest queued request may be passed over for one that batches with an instance's set
QUEUE_WINDOW = 16  # queued requests looked at for one that batches with an instance's set


class Source(Enum):
    """Why a route was chosen."""

    KV = "kv_prefix"  # the prompt's longest cached prefix is in KV cells of the instance
    RAM = "ram_prefix"  # ... in its host's store
    LOAD = "least_busy"  # no cached prefix: the least busy instance


Sets = Mapping[bytes, Collection[tuple[tuple[str, float], ...]]]
"""Each instance's adapter sets in use: those of the requests it runs (``Request.adapters``)."""


def affinity(adapters: tuple[tuple[str, float], ...], running: Collection[tuple[tuple[str, float], ...]]) -> int:
    """How cheaply an instance running requests of the adapter sets ``running`` takes one of ``adapters`` (the base
    model's, (), is a set too): 2 when it runs that set alone (they batch together), 1 when idle (it switches at
    once), 0 when it runs another set (sequences of different sets take turns of a few decode steps). Only a model with
    adapters is routed so; plain traffic spreads over instances by load."""
    if not running:
        return 1
    return 2 if all(s == adapters for s in running) else 0


def pick_queued(window: Sequence[tuple[tuple[tuple[str, float], ...], int]],
                alone: Collection[tuple[tuple[str, float], ...]]) -> int:
    """Which of the oldest queued requests (``window``: each one's adapter set and the times it was passed over)
    goes next, for a model with adapters: the oldest, unless its set is not among ``alone`` (the sets that an
    instance with a free slot runs alone) and a younger one's is, so that one batches there; the oldest is passed
    over at most MAX_PASSED times, then goes whatever it batches with."""
    head, passed = window[0]
    if head in alone or passed >= MAX_PASSED:
        return 0
    return next((i for i, (adapters, _) in enumerate(window) if adapters in alone), 0)


def stranded(names: Collection[str], held: Collection[Collection[str]], starting: bool) -> bool:
    """Whether a request for the LoRA adapters ``names`` can never start: instances of its model are registered
    (``held``: the adapters each has loaded or is loading), none has every one of ``names``, and none is
    ``starting`` (a starting instance is sent every adapter the model serves as it registers). With no instance
    registered the model's own rule applies (``mpserve.server.unserved``)."""
    return bool(held) and not starting and not any(set(names) <= set(h) for h in held)


@dataclass(frozen=True)
class Route:
    slots: list[tuple[bytes, int]]
    source: Source


def choose_slot(free: Iterable[tuple[bytes, int]], workers: Mapping[bytes, WorkerEntry], prompt: str,
                device: int | None = None, blocks: Sequence[int] = (), salt: bytes = b"",
                adapters: tuple[tuple[str, float], ...] = (), sets: Sets | None = None) -> tuple[bytes, int] | None:
    """A free slot (on ``device``, if given), in ``free``'s order (longest free first). First choice: one
    that can start from the longest cached prefix of ``prompt`` (at least MIN_SHARED_PREFIX characters),
    held in its own KV cells or, in a batching instance, in another slot's, which the worker copies, or in its
    instance's host store in RAM (``blocks``, the prompt's block hashes: whole blocks of it), which the
    worker restores. Of equal lengths, KV cells before RAM (a restore copies the state in; both spare the
    prefill), and the slot holding the prefix itself before the others. Otherwise: an instance by the request's
    ``adapters`` against the sets its requests use (``sets``; ``affinity``), so that requests of one set batch
    together; then a slot of the least busy instance (running sequences per slot), so that requests spread over
    instances before they share one's batch. Among equals, the slot free the longest. Slots' prompts count under
    ``salt`` only; ``blocks`` are hashed with it."""
    best = _best(free, workers, prompt, device, blocks, salt, adapters, sets)
    return best[0] if best is not None else None


def _held(entry: WorkerEntry, slot: int, salt: bytes) -> str:
    """``slot``'s last prompt, as far as a prompt of ``salt`` may reuse it: "" if it was another salt's."""
    held_salt, text = entry.prompts.get(slot, (b"", ""))
    return text if held_salt == salt else ""


def _best(free: Iterable[tuple[bytes, int]], workers: Mapping[bytes, WorkerEntry], prompt: str,
          device: int | None, blocks: Sequence[int], salt: bytes, adapters: tuple[tuple[str, float], ...] = (),
          sets: Sets | None = None) -> tuple[tuple[bytes, int], Source] | None:
    best: tuple[bytes, int] | None = None
    best_key: tuple[int, bool, int, int, float] = (-1, False, 0, 0, 0.0)
    held: dict[bytes, int] = {}  # worker -> the longest prefix any of its slots holds
    in_ram: dict[bytes, int] = {}  # worker -> the longest prefix its host store holds
    alike: set[bytes] = set()  # workers none of whose slots holds a prefix to route by: their slots rank alike,
    for identity, slot in free:  # so the first free one (free the longest) stands for all
        if identity in alike:
            continue
        entry = workers[identity]
        if device is not None and entry.device != device:
            continue
        own = anywhere = ram = 0
        if len(prompt) >= MIN_SHARED_PREFIX:
            own = common_prefix(_held(entry, slot, salt), prompt)
            if entry.capacity > 1 and identity not in held:
                held[identity] = max((common_prefix(_held(entry, s, salt), prompt) for s in entry.prompts), default=0)
            anywhere = max(own, held.get(identity, 0))
        if not _at_least(held.get(identity, own)):
            alike.add(identity)
        if blocks and entry.ram:
            if identity not in in_ram:
                in_ram[identity] = entry.ram.longest(blocks)
            ram = in_ram[identity]
        fit = affinity(adapters, sets.get(identity, ())) if sets is not None else 1
        key = (_at_least(max(anywhere, ram)), anywhere >= ram, _at_least(own), fit,
               -len(entry.running) / entry.capacity)
        if key > best_key:  # strictly better: among equals the first, free the longest, stays
            best, best_key = (identity, slot), key
    if best is None:
        return None
    return best, Source.LOAD if not best_key[0] else Source.KV if best_key[1] else Source.RAM


def choose_slots(free: Iterable[tuple[bytes, int]], workers: Mapping[bytes, WorkerEntry], prompt: str, n: int,
                 device: int | None = None, blocks: Sequence[int] = (), salt: bytes = b"",
                 adapters: tuple[tuple[str, float], ...] = (), sets: Sets | None = None) -> Route | None:
    """``n`` free slots of one instance (on ``device``, if given): the first as ``choose_slot`` picks it among
    the instances with ``n`` free, then that instance's other free ones, longest free first; None if no
    instance has ``n`` free slots."""
    if n == 1:  # every instance with a free slot has room
        best = _best(free, workers, prompt, device, blocks, salt, adapters, sets)
        return None if best is None else Route([best[0]], best[1])
    free = list(free)
    count: dict[bytes, int] = {}
    for identity, _ in free:
        count[identity] = count.get(identity, 0) + 1
    roomy = [f for f in free if count[f[0]] >= n]
    best = _best(roomy, workers, prompt, device, blocks, salt, adapters, sets)
    if best is None:
        return None
    first, source = best
    return Route([first, *[f for f in roomy if f[0] == first[0] and f != first][:n - 1]], source)


def _at_least(shared: int) -> int:
    """A shared prefix long enough to route by, else 0."""
    return shared if shared >= MIN_SHARED_PREFIX else 0


def crash_signal(code: int | None) -> Signals | None:
    """The signal a local worker's exit status ``code`` names (negative: the signal that ended it), if it is one
    of CRASH_SIGNALS: those the process raises on itself when its engine faults while it computes, which is
    what a request can make it do. None for SIGKILL, SIGTERM and the other signals that come from outside, for
    an exit with a code (the worker's own decision), and for an unknown status."""
    if code is None or code >= 0:
        return None
    try:
        sig = Signals(-code)
    except ValueError:
        return None
    return sig if sig in CRASH_SIGNALS else None


def describe_exit(code: int | None) -> str:
    """A worker's exit status in words: "signal SIGSEGV", "code 1"."""
    if code is None:
        return "unknown status"
    if code < 0:
        try:
            return f"signal {Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


class AfterLoss(Enum):
    RETRY = "retry"
    LOST = "worker_lost"
    POISON = "poison_request"
    BOUND = "handover_bound"  # answered worker_lost too, with the bound named


def after_loss(p: Pending) -> AfterLoss:
    """A running request whose worker died (``p.crashes`` or ``p.handovers`` already counts this death)."""
    if p.crashes >= MAX_CRASHES:
        return AfterLoss.POISON
    if p.handovers >= MAX_HANDOVERS:
        return AfterLoss.BOUND
    resumable = bool(p.generated) and p.tokens_known
    return AfterLoss.LOST if p.state is RequestState.STREAMING and not resumable else AfterLoss.RETRY


def crash_streak(mq: ModelQueue, tickets: Collection[str]) -> int:
    """``mq.crash_streak`` once a worker of the model crashed running ``tickets``: one more if any of them had not
    crashed yet in the streak (``mq.crashed``), however many did; the same for a crash with none running."""
    return mq.crash_streak + (not set(tickets) <= mq.crashed)
