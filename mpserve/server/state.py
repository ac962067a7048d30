"""The rows of the broker's three tables: requests (``Pending``), workers (``WorkerEntry``) and models
(``ModelQueue``).

A request's life in the broker (``RequestState``; llama.cpp's server draws its ``slot_state`` the same way):

    accepted ──▶ QUEUED ──assign──▶ RUNNING ──first CHUNK forwarded──▶ STREAMING
                   ▲ ▲                 │                                   │
                   │ └─ worker died ───┘ (retried: nothing was streamed,   │
                   │    or stalled       so nothing repeats)               │
                   └── worker died or stalled: resumed with the tokens ────┤ (``generated``: every
                       streamed so far, the rest of max_tokens             │  CHUNK's token ids)
                                                                           ▼
    RUNNING or STREAMING ──PREEMPT, its worker's PARKED──▶ QUEUED, parked on that worker (``parked_on``): it
                           resumes there, where its sequence is held (``mpserve.server.preemption``)
    any state ──DONE / ERROR / cancel / timeout / client gone / worker lost──▶ ANSWERED ──▶ removed

ANSWERED means its one terminal message was sent (or the client is gone). A request answered while a worker
still runs it (cancelled, timed out) stays in the table until that worker's late reply frees the slot;
``Pending.worker`` says which worker holds it, None while it is queued.

A request for ``n`` choices is n rows, one per choice (``group``: their tickets), which the client sees as
one request: the first waits in the queue for n free slots of one instance, where all n start together
(the instance computes the shared prompt once), and the requests behind it wait too, so that it is not
starved; the first ERROR answering any of them answers them all. Once started each choice is a request of
its own to its worker: one whose worker is lost is retried or handed over alone (one slot, any instance,
from its own tokens), as a request for one is.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from mpserve.wire import protocol as wire
from mpserve.wire.adapters import Served
from mpserve.wire.protocol import ChatTemplate

from .ram_prefixes import RamPrefixes
from .tenants import FairQueue


class RequestState(Enum):
    QUEUED = "queued"
    RUNNING = "running"
    STREAMING = "streaming"  # a CHUNK reached the client: a retry would repeat text
    ANSWERED = "answered"


@dataclass
class Pending:
    ticket: str
    client: bytes
    request: wire.Request
    model: str
    accepted: float  # monotonic
    deadline: float | None
    state: RequestState = RequestState.QUEUED
    assigned: float = 0.0  # monotonic, the last assignment
    first_assigned: float = 0.0  # monotonic: with ``first_token``, the whole request's timings after a hand-over
    first_token: float = 0.0  # monotonic, its first CHUNK (0: none yet)
    crashes: int = 0  # workers that crashed or stalled under it (``mpserve.server.routing``: crash, hand-over)
    handovers: int = 0  # workers lost under it to causes not its own
    attempts: int = 0
    worker: bytes | None = None
    generated: bytearray = field(default_factory=bytearray)  # token ids streamed so far (TOKENS frames)
    tokens_known: bool = True  # False once a CHUNK came without its token ids: it cannot be resumed
    kept: list[bytes] | None = field(default_factory=list)  # its CHUNK bodies so far, for another client to take it
    # up (``mpserve.server.rebind``); None once let go
    kept_bytes: int = 0  # their size
    group: tuple[str, ...] = ()  # a request for n choices: the tickets of all n (this one among them)
    index: int = 0  # which choice this row is
    slots_needed: int = 1  # queued as a request for n: the n free slots of one instance it waits for
    blocks: tuple[int, ...] | None = None  # its prompt's block hashes, once routing needed them
    routed: str | None = None  # its prompt as routing reads it (``wire.prefix.routed``: images by key), once needed
    salt: bytes | None = None  # its reuse namespace (``mpserve.wire.salt``), once routing needed it
    tenant: str = ""  # whose it is (``mpserve.server.tenants``): its connection's, or the gateway's word for it
    priority: int = 0  # as asked, capped by its tenant's max_priority: higher starts first
    cost: float = 0.0  # the slot seconds its tenant was charged for it when it started (``FairQueue``)
    passed: int = 0  # times a younger request went first, to batch with an instance's adapters (``pick_queued``)
    preempting: bool = False  # a PREEMPT went to its worker; its PARKED (or its end) has not come back
    preemptions: int = 0  # times it was preempted (``preemption.MAX_PREEMPTIONS`` bounds them)
    parked_on: bytes | None = None  # queued again after a preemption: the worker holding its sequence
    waiting_since: float = 0.0  # monotonic: when it was queued again (0: it waits since ``accepted``)
    waited_for: str = "queue"  # why it waits: its first wait, or the cause of its latest (``spans.requeued``)

    @property
    def answered(self) -> bool:
        return self.state is RequestState.ANSWERED


@dataclass
class WorkerEntry:
    identity: bytes
    index: int | None  # the local supervisor's worker index; None for a worker of a remote pool
    model: str
    device: int
    capacity: int
    pid: int
    loaded: bool = True
    unloading: bool = False
    host: str = ""
    last_heard: float = 0.0  # monotonic; remote workers are declared lost when silent too long
    running: dict[str, int] = field(default_factory=dict)  # ticket -> slot
    prompts: dict[int, tuple[bytes, str]] = field(default_factory=dict)  # slot -> the salt and text of its last
    # prompt (cached in its KV; reused for a prompt of the same salt only, ``mpserve.wire.salt``)
    ram: RamPrefixes = field(default_factory=RamPrefixes)  # what its host's store holds (CACHE frames); shared
    # by every instance of the model on that host (``ModelQueue.stores``)
    draining: bool = False  # being scaled down: no new requests; STOP once it runs nothing
    unreachable: bool = False  # a send to it failed (said once), until it is heard from again
    adapters: frozenset[str] = frozenset()  # the LoRA adapters it has loaded (READY, ADAPTER_REPLY): it runs only
    # requests whose adapters are all among them
    parked: set[str] = field(default_factory=set)  # tickets of the queued requests whose sequence it holds parked
    code: str = ""  # its mpserve version and link revision (``mpserve.worker.spec.revision``'s form; READY's)
    engine: str = ""  # a digest of the settings it runs (``EngineSpec.digest``; READY's)


@dataclass(frozen=True)
class Lost:
    """How a model's last instance went: ``what`` happened (the broker's words), ``at`` (monotonic), and whether it
    was a remote pool's."""

    what: str
    at: float
    remote: bool


@dataclass
class ModelQueue:
    name: str
    max_queue: int
    queue: FairQueue = field(default_factory=FairQueue)  # tickets, by priority, then fair shares of the tenants
    free: deque[tuple[bytes, int]] = field(default_factory=deque)  # (worker, slot), longest-free first
    instances: int = 0  # workers registered (READY) and alive
    failed: str | None = None  # why the model failed, after "model NAME " (``refusal``): it cannot be loaded, or
    # its workers crash on every request; once failed, it serves nothing more
    crash_streak: int = 0  # its workers' crashes since its last DONE, each on a request new to the streak ...
    crashed: set[str] = field(default_factory=set)  # ... not among these tickets (``mpserve.server.routing``)
    chat: ChatTemplate = ChatTemplate()  # from the workers' READY (``mpserve.server.chat``); empty until one had
    # the model loaded
    chat_local: bool = False  # ``chat`` came from a local instance: no READY changes it
    service_ms: float = 0.0  # running mean of assignment-to-answer time, for the busy retry-after hint
    stores: dict[str, RamPrefixes] = field(default_factory=dict)  # host ("": this one) -> what its store holds
    unserved_since: float | None = None  # monotonic: since when no instance can serve it (``mpserve.server.unserved``)
    lost: Lost | None = None  # how its last instance went, once one did
    adapters: Served = field(default_factory=Served)  # its LoRA adapters served now, with their ids
    adapter_paths: dict[str, str] = field(default_factory=dict)  # those loaded at run time: name -> file (a new
    # instance is sent them: ``mpserve.server.adapter_ops``)
    preempted: int = 0  # its requests preempted since start

    def store(self, host: str) -> RamPrefixes:
        """The view of ``host``'s store (one per host: any instance there restores what another saved); it
        outlives the instances (an unload, a crash), as the store does."""
        return self.stores.setdefault(host, RamPrefixes())

    def refusal(self) -> str:
        """What a request for the failed model is told."""
        return f"model {self.name} {self.failed}"
