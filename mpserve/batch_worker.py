"""A worker with ``parallel`` K > 1: one llama.cpp context decoding up to K requests together.

Its loop alternates between taking broker messages and running one ``BatchEngine.step``: newly
assigned requests are admitted into the slot the broker chose (the one whose cache fits the prompt),
every running sequence gets one token per step, cancellations take effect at the next step, and each
sequence that ends is answered at once while the others go on. The worker holds its GPU permit while
it has any sequence running, and gives it back when the last one ends.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from . import protocol as wire
from .batch import BatchEngine
from .errors import Cancelled, MpserveError
from .permits import Permit
from .slots import SlotState
from .worker import PARENT_CHECK_S, ChunkStream, Worker

log = logging.getLogger("mpserve.worker")


class BatchWorker(Worker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._running: dict[str, wire.Assign] = {}  # ticket -> its assignment
        self._slot_of: dict[str, int] = {}
        self._streams: dict[str, ChunkStream] = {}  # ticket -> its streamed text, for streamed requests
        self._cancelled_tickets: set[str] = set()
        self._permit: Permit | None = None

    def _build_engine(self) -> BatchEngine:
        e = self._spec.engine
        return BatchEngine(e.path, e.n_ctx, e.parallel, e.threads, e.n_gpu_layers, e.seed, flash_attn=e.flash_attn,
                           repack=e.repack)

    @property
    def _busy(self) -> bool:
        return bool(self._running)

    def run(self) -> None:
        spec = self._spec
        self._register()
        idle_since = time.monotonic()
        while not self._stopping:
            wait_ms = 0 if self._running else int(min(PARENT_CHECK_S, spec.heartbeat_interval) * 1000)
            if self._sock.poll(wait_ms):
                while self._sock.poll(0):
                    self._receive()
            if self._running:
                self._step()
                idle_since = time.monotonic()
            self._keep_alive()
            if (self._engine is not None and not self._running and spec.idle_timeout
                    and time.monotonic() - idle_since >= spec.idle_timeout):
                log.info("idle for %.0f s; unloading the model until the next request", spec.idle_timeout)
                self._unload()
        for ticket in list(self._running):  # stopping with requests running: they end as cancelled
            self._end(ticket, wire.Error(self._running[ticket].request.id, "cancelled", "the worker is stopping"))
        self.set_rows(state=SlotState.STOPPING)

    # --- the broker's messages ------------------------------------------------------------------

    def _accept(self, assign: wire.Assign) -> None:
        """Admit the request into the slot the broker chose (any free one if that is taken)."""
        if self._engine is None:  # unloaded by the idle watchdog: the request waits for the load
            self.load()
        engine: BatchEngine = self._engine
        free = engine.free_slots()
        if not free:
            self._send(wire.Error(assign.request.id, "internal", "worker was given a request while full"),
                       assign.ticket)
            return None
        slot = assign.slot if assign.slot in free else free[0]
        req = assign.request
        row = self._rows[slot]
        stream = self._stream(assign)

        def on_token(text: str, tokens: int) -> bool:
            row.progress(tokens)
            if stream is not None and text:
                stream.push(text)
            return not self._stopping

        try:
            engine.admit(slot, req.prompt, req.params, on_token)
        except MpserveError as exc:
            self._send(wire.Error(req.id, exc.code, exc.message), assign.ticket)
            return None
        self._running[assign.ticket] = assign
        self._slot_of[assign.ticket] = slot
        if stream is not None:
            self._streams[assign.ticket] = stream
        row.update(state=SlotState.BUSY if self._permit or not self._permits else SlotState.WAITING,
                   request=req.id, tokens=0)
        return None

    def _cancel(self, ticket: str) -> None:
        if ticket in self._slot_of:
            self._engine.cancel(self._slot_of[ticket])
            self._cancelled_tickets.add(ticket)

    def _void_running(self) -> None:
        for ticket in self._running:
            self._cancel(ticket)

    # --- stepping -------------------------------------------------------------------------------

    def _step(self) -> None:
        if self._permits is not None and self._permit is None:
            try:
                self._permit = self._permits.acquire(stop=self._nothing_left)
            except Cancelled:  # all were cancelled while queueing: the step below only ends them
                pass
            else:
                for ticket in self._running:
                    self._rows[self._slot_of[ticket]].update(state=SlotState.BUSY)
        try:
            finished = self._engine.step()
        except Exception:  # a llama.cpp failure leaves the context in doubt: fail what runs, and restart
            log.exception("a batch step failed; ending %d request(s) and restarting", len(self._running))
            for ticket in list(self._running):
                self._end(ticket, wire.Error(self._running[ticket].request.id, "internal", "the batch step failed"))
            sys.exit(1)
        by_slot = {slot: ticket for ticket, slot in self._slot_of.items()}
        for slot, completion in finished:
            ticket = by_slot[slot]
            self._end(ticket, self._reply(self._running[ticket], completion))
        if not self._running and self._permit is not None:
            self._permit.release()
            self._permit = None

    def _nothing_left(self) -> bool:
        """While queueing for the permit: stop waiting once every running request was cancelled."""
        self._pump()
        return self._stopping or all(t in self._cancelled_tickets for t in self._running)

    def _end(self, ticket: str, outcome: wire.Done | wire.Error) -> None:
        assign = self._running.pop(ticket)
        self._cancelled_tickets.discard(ticket)
        slot = self._slot_of.pop(ticket)
        self._served += 1
        self._rows[slot].update(state=SlotState.IDLE, served=self._served)
        self._answer(assign, outcome, self._streams.pop(ticket, None))
