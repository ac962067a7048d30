"""A worker's loop: one engine, ``parallel`` slots, driven by the broker's messages over one DEALER.

    broker --ASSIGN/CANCEL/PREEMPT/STOP/HAND_OFF/UNLOAD/TOKENIZE/SLOT_ACTION/ADAPTER_ACTION--> worker
    worker --READY/FAILED/UNLOADED, then CHUNK*/DONE|ERROR|PARKED (TOKENS, SLOT_REPLY, ADAPTER_REPLY) per ticket-->
           broker
           (a DONE or ERROR carries the host store's changes since the last one: the CACHE frame; a READY
           all its entries, so that a broker that restarted learns them)

Each turn takes every waiting broker message, then runs one ``engine.step`` while any sequence runs:

    receive   ASSIGN (several: ASSIGNS): admit the request into the slot the broker chose (another free one
              if that is taken; a ticket it parked: that sequence resumed there); CANCEL: the sequence ends at
              the next step (a parked one is forgotten); PREEMPT: the sequence parked (``_preempt``); STOP;
              UNLOAD (only when idle);
              TOKENIZE, EMBED: answered at once (``mpserve.worker.tokens``, ``mpserve.worker.embed``);
              SLOT_ACTION: an idle slot saved, restored or erased at once (``mpserve.worker.slot_files``);
              ADAPTER_ACTION: a LoRA adapter loaded or unloaded at once (``mpserve.worker.adapter_actions``): READY
              names the adapters loaded, and each slot row the ones its sequence runs under
    permit    with GPU permits, the first running sequence takes the device's permit (host-wide); the
              last one to end gives it back
    step      every running sequence advances by one token (a prompt by a chunk); pieces stream out as
              CHUNKs (``ChunkStream``); each sequence that ended is answered (DONE or ERROR) after its
              last CHUNK. What a step (or a turn's receiving) produced goes as one STEP message (a
              plain CHUNK, DONE or ERROR when it is one), before anything else the worker sends
    kv events  with ``--kv-events``: the blocks its cells gained and lost, published (``kv_publisher``)
    keep alive  heartbeats both ways; register again if the broker went silent (``link``); exit if the server died;
              unload the model after ``idle_timeout`` without a request
    orphaned  the server died (its pidfd readable) and ``adopt_wait`` is set: every running sequence is parked, the
              link connects afresh, and READY goes out with LIVE (each held request, and each answer sent just before:
              ``offers``) until a new server's broker answers (HEARTBEAT with its pid, watched from then on:
              ``mpserve.server.adoption``); its rows move to the new slot table. None within ``adopt_wait``: leave.
              HAND_OFF (an upgrade) does the same, its READY answering the broker that is handing it off first
    leave     told to STOP, terminated (SIGTERM), or the server (pool) gone: LEAVING, the engine closed, and exit;
              the requests still running are not answered: the broker hands them over at once, as a lost worker's

The same loop serves models (``BatchEngine``) and the echo backend (``EchoEngine``): one interface,
``mpserve.engine.interface.Engine``.

For the tests only: with ``$MPSERVE_TEST_CRASH_ON`` set (read when the worker starts; the server's
environment reaches its workers), a request whose prompt contains its value kills the worker with SIGSEGV as
it is admitted, as an engine that faults on a request does (``tests/test_crashes.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import resource
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import zmq

from mpserve import __version__
from mpserve.engine.interface import Completion, Engine
from mpserve.errors import Cancelled, ErrorCode, MpserveError
from mpserve.gpu.permits import DevicePermits, Permit
from mpserve.wire import protocol as wire
from mpserve.wire import zmqio
from mpserve.wire.protocol import ChatTemplate
from mpserve.wire.slots import CacheRow, SlotState, SlotTable, SlotWriter, adapter_label

from . import adapter_actions, embed, offers, slot_files, spans, tokens
from .kv_publisher import open_publisher
from .link import BrokerLink
from .outbox import Outbox
from .spec import EXIT_LOAD_FAILED, EngineSpec, WorkerSpec
from .stream import ChunkStream, Noted, answer

log = logging.getLogger("mpserve.worker")

CRASH_ON = "MPSERVE_TEST_CRASH_ON"  # the tests' crash injection (see the module's docstring)


def _crash() -> None:
    """Die of SIGSEGV, as a fault in the engine ends the process, without leaving a core file (``CRASH_ON``)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.raise_signal(signal.SIGSEGV)


class Worker:
    def __init__(self, spec: WorkerSpec, sock: zmq.Socket[Any], rows: list[SlotWriter],
                 build_engine: Callable[[EngineSpec], Engine], permits: DevicePermits | None = None) -> None:
        self._spec = spec
        self._sock = sock
        self._poller = zmq.Poller()  # one, registered once (``Socket.poll`` builds a Poller per call)
        self._poller.register(sock, zmq.POLLIN)
        self._link = BrokerLink(spec, sock, self._poller)  # the server's pidfd in the poll too: an idle worker
        # wakes when the server dies
        self._rows = rows
        self._build_engine = build_engine
        self._adapters = dict(spec.engine.adapters)  # declared, then as loaded and unloaded since (adapter_actions)
        self._permits = permits
        self._permit: Permit | None = None
        self._engine: Engine | None = None
        self._running: dict[str, wire.Assign] = {}  # ticket -> its assignment
        self._slot_of: dict[str, int] = {}
        self._streams: dict[str, ChunkStream] = {}  # ticket -> its streamed text, for streamed requests
        self._noted: dict[str, Noted] = {}  # ticket -> the token ids its text streams with (``report_tokens``)
        self._parked: dict[str, offers.Held] = {}  # tickets whose sequence the engine holds parked (``_preempt``)
        self._said: dict[str, offers.Said] = {}  # ticket -> what it streamed so far (a LIVE's, if orphaned)
        self._sent = offers.Sent()  # the answers sent last, for a death of the server
        self._taken_over: set[str] = set()  # tickets admitted with another instance's tokens: their text is not all
        # here (``offers.live``)
        self._out = Outbox()  # this step's CHUNKs, DONEs and ERRORs, sent together
        self._cache_row: CacheRow | None = None  # as the rows last had it (``_note_cache``)
        self._cancelled_tickets: set[str] = set()
        self._served = 0
        self._stopping = False
        self._leaving: str | None = None  # why the worker leaves on its own (not told to stop): for LEAVING
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._crash_on = os.environ.get(CRASH_ON) or None
        self._kv_events = open_publisher(spec.kv_events, spec.index, spec.model)  # None: no --kv-events
        self._spans = spans.for_worker(spec.identity.decode())  # None while tracing is off

    def set_rows(self, **fields: Any) -> None:
        for row in self._rows:
            row.update(**fields)

    def load(self) -> None:
        """Load the model; on failure tell the broker why (FAILED) and exit for the supervisor to decide."""
        self.set_rows(state=SlotState.LOADING)
        t0 = time.perf_counter()
        try:
            self._engine = self._build_engine(dataclasses.replace(self._spec.engine, adapters=dict(self._adapters)))
        except Exception as exc:  # any load failure is reported the same way
            log.error("cannot load %s: %s", self._spec.engine.path, exc)
            self.set_rows(state=SlotState.FAILED)
            self._send(wire.Failed(self._spec.identity.decode(), self._spec.model, f"{type(exc).__name__}: {exc}",
                                   proof=self._spec.proof))
            sys.exit(EXIT_LOAD_FAILED)
        self.set_rows(state=SlotState.IDLE, load_s=time.perf_counter() - t0)
        self._note_cache()
        log.debug("loaded in %.2f s (repack=%s, threads=%d)", time.perf_counter() - t0, self._spec.engine.repack,
                  self._spec.engine.threads)
        if self._link.registered:  # loaded on demand: tell the broker (its chat template, and that the load worked)
            self._register()

    def run(self) -> None:
        spec = self._spec
        self._register()
        idle_since = time.monotonic()
        while not self._leaving_now():
            wait_ms = 0 if self._running else int(spec.heartbeat_interval * 1000)
            if self._poller.poll(wait_ms):
                self._receive_all()
            if self._running:
                self._step()
                idle_since = time.monotonic()
            self._keep_alive()
            if self._kv_events is not None:
                self._kv_events.turn(self._engine)
            if (self._engine is not None and not self._running and spec.idle_timeout
                    and time.monotonic() - idle_since >= spec.idle_timeout):
                log.info("idle for %.0f s; unloading the model until the next request", spec.idle_timeout)
                self._unload()
        self._leave()

    def _leave(self) -> None:
        """LEAVING, once the broker has all the text its running requests generated (what their streams gathered)
        and the engine kept what the instances they are handed over to restore of them (they are not answered: the
        broker hands them over at once, as a lost worker's); then the engine closed, its slots' cells and the host
        store's writes kept (after LEAVING: the hand-over need not wait for it)."""
        for stream in self._streams.values():
            stream.flush()
        self._flush()
        self.set_rows(state=SlotState.STOPPING)
        if self._engine is not None and self._running:
            self._engine.keep_running()
        self._signal(wire.Leaving(self._spec.identity.decode(), self._leaving or "told to stop"))
        if self._engine is not None:
            self._engine.close()
        if self._kv_events is not None:
            self._kv_events.close()

    def _leaving_now(self) -> bool:
        """Told to stop, or leaving on its own: LEAVING after this turn's step (none if it waits for a permit)."""
        return self._stopping or self._leaving is not None

    def leave_on(self, signum: int) -> None:
        """On ``signum`` (SIGTERM), stop after the current step and tell the broker (LEAVING), which hands the
        running requests over at once. A handler only notes it: the loop acts; the signal wakes its poll."""
        read, write = socket.socketpair()
        read.setblocking(False)
        write.setblocking(False)
        self._wakeup = read, write  # open for the process's life
        self._poller.register(read, zmq.POLLIN)
        signal.set_wakeup_fd(write.fileno())

        def note(signo: int, frame: FrameType | None) -> None:
            self._leaving = f"it got {signal.Signals(signo).name}"

        signal.signal(signum, note)

    # --- the link to the broker ---------------------------------------------------------------------

    def _register(self) -> None:
        spec = self._spec
        chat = self._engine.chat if self._engine is not None else ChatTemplate()
        cache = self._engine.cache_snapshot() if self._engine is not None else None  # for a broker that restarted
        live = (offers.live(self._parked, self._said, self._taken_over, self._sent) if self._link.orphaned_now
                else ())  # its requests, and its answers sent last, for the next server
        ready = wire.Ready(spec.identity.decode(), spec.model, spec.device, spec.engine.parallel, os.getpid(),
                           loaded=self._engine is not None, host=spec.host, version=__version__,
                           engine=spec.engine.digest(), chat_template=chat.template,
                           bos_token=chat.bos_token, eos_token=chat.eos_token, proof=spec.proof,
                           adapters=self._engine.adapter_names() if self._engine is not None else
                           tuple(sorted(self._adapters)), live=live)
        self._link.registering()
        self._signal(ready, trailer=wire.pack(cache) if cache else None)

    def _keep_alive(self) -> None:
        """Heartbeats both ways (``link``): send one every interval; if the broker has been silent for interval ×
        liveness, register again, backing off with jitter, so that a broker that restarted or declared this worker
        lost gets it back. Also: exit if the server is gone, or wait to be adopted (orphaned)."""
        spec, link = self._spec, self._link
        now = time.monotonic()
        if link.orphan_until is not None:
            if now >= link.orphan_until:
                log.warning("no server adopted it within %g s; leaving", spec.adopt_wait)
                self._leaving = f"its server died, and none adopted it within {spec.adopt_wait:g} s"
        elif self._leaving is None and link.server_gone():
            # every turn (one syscall): the requests of a dead pool's worker are handed over after one step more
            starter = "pool" if spec.pool else "server"
            if spec.adopt_wait and not spec.pool:
                self._orphaned()
            else:
                log.warning("its %s (pid %d) is gone; leaving", starter, spec.parent_pid)
                self._leaving = f"its {starter} (pid {spec.parent_pid}) is gone"
        if link.heartbeat_due(now):
            self._signal(wire.Heartbeat(spec.identity.decode()))
            self._note_cache()  # what the store's writer thread and other instances changed meanwhile
        silent = link.silent_for(now)
        if not self._running and link.register_due(now, silent is not None):
            if silent is not None:  # on a new connection: the broker takes none under a name still connected (a
                # dead link it has not dropped yet), and ZeroMQ would keep this one, unheard, for good
                log.warning("no word from the broker for %.1f s; connecting and registering again", silent)
                link.reconnect()
            self._register()

    def _orphaned(self, reconnect: bool = True) -> None:
        """The server died: park what runs, forget what was on its way to the dead broker, connect afresh and offer
        the held requests, and the answers sent last (``offers.Sent``), to the next server (READY with LIVE) for
        ``adopt_wait`` seconds (``Worker.run`` goes on turning: nothing runs, so it waits for the broker's messages a
        heartbeat at a time), again on a new link after each ``link.ORPHAN_RETRY_S`` of silence. Handed off
        (``reconnect`` False): the first READY answers the broker handing it off, on the link it has."""
        for ticket in list(self._running):
            if ticket not in self._cancelled_tickets:
                self._park(ticket)
        self._out.take()
        if reconnect:  # the dead broker may not have read the answers sent last: offered with the parked requests
            self._sent.hold()
        log.warning("its server died; holding %d request(s) for a new server to adopt this instance (%g s at most)",
                    len(self._parked), self._spec.adopt_wait)
        self._link.orphaned(reconnect)

    def _adopted(self, server_pid: int) -> None:
        """A new server's broker took this worker (its HEARTBEAT with the server's pid): watch that server from now
        on, and move the rows into its slot table (made anew at the same path)."""
        self._link.adopted(server_pid)
        try:
            table = SlotTable.attach(Path(self._spec.slots_path))
        except (OSError, ValueError) as exc:
            log.warning("adopted by the server (pid %d), but its slot table is not usable (%s); the rows stay "
                        "unseen", server_pid, exc)
        else:
            self._rows = [table.writer(row, like=old) for row, old in zip(self._spec.rows, self._rows, strict=True)]
        log.info("adopted by the server (pid %d); holding %d request(s) for it", server_pid, len(self._parked))

    def _receive_all(self) -> None:
        """Take every waiting broker message and act on each; then send the answers that gave (an ASSIGN
        refused)."""
        while zmqio.readable(self._sock):
            self._receive(zmqio.recv(self._sock, zmqio.NOBLOCK))
        self._flush()

    def _receive(self, frames: list[bytes]) -> None:
        """Act on one broker message."""
        self._link.heard()
        try:
            msg = wire.decode(frames)
        except MpserveError as exc:
            log.error("dropped a bad message from the broker: %s", exc)
            return
        if isinstance(msg, wire.Heartbeat) and not msg.registered:
            self._link.must_register = True  # the broker does not know this worker (any more)
            if not self._link.orphaned_now:  # an orphan's held requests go in its READY, for the broker to adopt
                for ticket in [*self._running, *self._parked, *(a.assign.ticket for a in self._sent.held())]:  # void
                    self._cancel(ticket)
        elif isinstance(msg, wire.Heartbeat) and self._link.orphaned_now and msg.pid:
            self._adopted(msg.pid)
        elif isinstance(msg, wire.Heartbeat):
            self._sent.beat()
        elif isinstance(msg, wire.Error):
            log.error("the broker refused this worker: %s", msg.message)
            sys.exit(EXIT_LOAD_FAILED)
        elif isinstance(msg, wire.Stop):
            self._stopping = True
        elif isinstance(msg, wire.HandOff):
            if not self._link.orphaned_now and not self._spec.pool:
                self._orphaned(reconnect=False)
        elif isinstance(msg, wire.Unload):
            if not self._running:
                self._unload()
            else:  # the broker unloads only idle workers; say so rather than drop a running request
                log.error("asked to unload while serving; ignored")
        elif isinstance(msg, wire.Cancel):
            self._cancel(msg.id)
        elif isinstance(msg, wire.Preempt):
            self._preempt(msg.ticket)
        elif isinstance(msg, wire.Assign):
            self._accept(msg)
        elif isinstance(msg, wire.Assigns):
            for assign in msg.assigns:
                self._accept(assign)
        elif isinstance(msg, wire.SlotAction):
            reply = slot_files.answer(self._engine, self._spec.slot_save_path, msg)
            if isinstance(reply, wire.SlotReply) and self._engine is not None:
                self._rows[msg.slot].update(kv_cells=self._engine.kv_cells(msg.slot))
            self._send(reply, msg.ticket)
        elif isinstance(msg, wire.AdapterAction):
            self._send(adapter_actions.answer(self._engine, self._adapters, self._spec, msg), msg.ticket)
        elif isinstance(msg, wire.Tokenize):
            self._send(tokens.answer(self._engine, msg) if self._engine is not None else wire.Error(
                msg.id, ErrorCode.BUSY, "the model is not loaded here now; retry"), msg.ticket)
        elif isinstance(msg, wire.Embed):
            self._send(embed.answer(self._engine, msg) if self._engine is not None else wire.Error(
                msg.id, ErrorCode.BUSY, "the model is not loaded here now; retry"), msg.ticket)

    def _pump(self) -> None:
        """While waiting for a permit: take what the broker sent, and keep the link alive."""
        self._receive_all()
        self._keep_alive()

    def _send(self, msg: object, ticket: str = "", trailer: bytes | None = None) -> None:
        self._flush()
        zmqio.send(self._sock, wire.encode_from_worker(msg, ticket, trailer))

    def _signal(self, msg: wire.Ready | wire.Heartbeat | wire.Leaving, trailer: bytes | None = None) -> None:
        """A message about the link itself, which the worker sends again (READY, HEARTBEAT) or the broker does
        without (LEAVING: silence says as much): after what the step gathered, sent only if the socket has room,
        else dropped. A broker that refused this worker's CURVE keys leaves its socket no connection, so no room,
        for good: a blocking send held the loop there, and with it the exit and the silence check that connects
        afresh (where a key allowed since gets in)."""
        self._flush()
        with contextlib.suppress(zmq.Again):
            zmqio.send(self._sock, wire.encode_from_worker(msg, "", trailer), zmqio.NOBLOCK)

    def _answer(self, outcome: wire.Done | wire.Error, ticket: str) -> bytes:
        """A request's DONE or ERROR, with a CACHE frame when the host store gained or lost entries since the
        last one (the broker's routing learns from it where prefixes are); it goes out with the step's. Its body."""
        changes = self._engine.take_cache_changes() if self._engine is not None else None
        self._queue(outcome.TYPE, ticket, body := wire.pack(outcome), wire.pack(changes) if changes else None)
        return body

    def _queue(self, mtype: wire.MsgType, ticket: str, body: bytes, trailer: bytes | None) -> None:
        if not self._out.fits(body, trailer):
            self._flush()
        self._out.add(mtype, ticket, body, trailer)

    def _flush(self) -> None:
        """What was gathered since the last send: one message as itself, several as one STEP."""
        frames = self._out.take()
        if frames is not None:
            zmqio.send(self._sock, frames)

    def _unload(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        for ticket in self._parked:  # a resume admits them again, from their tokens
            self._said.pop(ticket, None)
            self._taken_over.discard(ticket)
        self._parked.clear()
        self.set_rows(state=SlotState.UNLOADED, kv_cells=0)
        self._note_cache()
        self._send(wire.Unloaded(self._spec.identity.decode()))

    # --- requests -----------------------------------------------------------------------------------

    def _accept(self, assign: wire.Assign) -> None:
        """Admit the request into the slot the broker chose (any free one if that is taken)."""
        if (sent := self._sent.take(assign.ticket)) is not None:  # it ended as its server died: its answer again
            self._queue(sent.outcome, assign.ticket, sent.body, None)
            return
        if self._engine is None:  # unloaded by the idle watchdog: the request waits for the load
            self.load()
        engine = self._engine
        assert engine is not None
        free = engine.free_slots()
        if not free:
            self._answer(wire.Error(assign.request.id, ErrorCode.INTERNAL, "worker was given a request while full"),
                         assign.ticket)
            return
        slot = assign.slot if assign.slot in free else free[0]
        req = assign.request
        row = self._rows[slot]
        stream, noted = self._stream(assign, slot)

        def on_token(text: str, tokens: int) -> bool:
            row.progress(tokens, engine.kv_cells(slot))
            if noted is not None:
                noted.note()
            if stream is not None and text:
                stream.push(text)
            return True

        resumed = assign.ticket in self._parked and engine.resume(assign.ticket, slot, on_token)
        self._parked.pop(assign.ticket, None)
        if not resumed and assign.generated:  # handed over from another instance (a resumed one goes on here)
            self._taken_over.add(assign.ticket)
        if resumed and noted is not None:
            noted.seen = len(engine.tokens(slot))  # reported before it was parked
        if not resumed and self._crash_on is not None and self._crash_on in req.prompt:
            _crash()
        try:
            if not resumed:  # ahead of every running request (it may have preempted one): its prompt goes first
                ahead = bool(self._running) and all(req.priority > a.request.priority for a in self._running.values())
                engine.admit(slot, wire.unpack_tokens(req.tokens) if req.tokens else req.prompt, req.params,
                             on_token, wire.frame_tokens(assign.generated), req.adapters, assign.salt, alone=ahead,
                             images=req.images)
        except MpserveError as exc:
            self._answer(wire.Error(req.id, exc.code, exc.message), assign.ticket)
            return
        self._note_cache()
        self._running[assign.ticket] = assign
        self._slot_of[assign.ticket] = slot
        if self._spans is not None:
            self._spans.accepted(assign)
        if stream is not None:
            self._streams[assign.ticket] = stream
        if noted is not None:
            self._noted[assign.ticket] = noted
        row.update(state=SlotState.BUSY if self._permit or not self._permits else SlotState.WAITING,
                   request=req.id, tokens=0, kv_cells=engine.kv_cells(slot),
                   adapters=adapter_label(engine.slot_adapters(slot)))

    def _note_cache(self) -> None:
        """The host store's figures, in each of this instance's rows, when they changed (every row is written): after
        a load, an unload and an admission, and on each heartbeat (for the store's writer thread, which adds, evicts
        and skips entries between admissions)."""
        s = self._engine.cache_stats() if self._engine is not None else None
        cache = CacheRow(s.bytes, s.capacity, s.hits, s.misses, s.evictions, s.disk_bytes, s.disk_capacity,
                         s.skipped, *dataclasses.astuple(s.remote)) if s is not None else CacheRow.empty()
        if cache == self._cache_row:
            return
        self._cache_row = cache
        for row in self._rows:
            row.cache(cache)

    def _cancel(self, ticket: str) -> None:
        self._sent.drop(ticket)
        if ticket in self._slot_of and self._engine is not None:
            self._engine.cancel(self._slot_of[ticket])
            self._cancelled_tickets.add(ticket)
        elif ticket in self._parked:
            del self._parked[ticket]
            self._said.pop(ticket, None)
            self._taken_over.discard(ticket)
            if self._engine is not None:
                self._engine.drop(ticket)

    def _preempt(self, ticket: str) -> None:
        """PREEMPT: the request's text gathered so far goes out, its sequence is parked (``Engine.park``: held
        whole, to resume exactly where it stopped when an ASSIGN with its ticket comes) and its slot is free;
        PARKED says so, after those CHUNKs, with the ids of the tokens noted since (their text held back by the
        engine). Nothing if the request ended or is ending: its DONE or ERROR answers it."""
        slot, engine = self._slot_of.get(ticket), self._engine
        if slot is None or engine is None or ticket in self._cancelled_tickets:
            return
        held = self._park(ticket)
        if held is not None:
            self._queue(wire.MsgType.PARKED, ticket, wire.pack(wire.Parked(self._parked[ticket].assign.request.id)),
                        wire.token_frame(held) if held else None)

    def _park(self, ticket: str) -> list[int] | None:
        """Park the sequence of ``ticket`` (its text so far sent first) and free its slot; the ids of the tokens
        noted since its last CHUNK, or None if it could not be parked (it ended, or is ending)."""
        slot, engine = self._slot_of[ticket], self._engine
        assert engine is not None
        stream = self._streams.get(ticket)
        if stream is not None:
            stream.flush()
        tokens = list(engine.tokens(slot))  # a sequence still running: no end-of-generation token among them
        if not engine.park(slot, ticket):
            return None
        assign = self._running.pop(ticket)
        del self._slot_of[ticket]
        self._streams.pop(ticket, None)
        noted = self._noted.pop(ticket, None)
        self._parked[ticket] = offers.Held(assign, tokens)
        self._rows[slot].update(state=SlotState.IDLE, kv_cells=engine.kv_cells(slot))
        if not self._running and self._permit is not None:
            self._permit.release()
            self._permit = None
        return noted.take() if noted is not None else []

    def _stream(self, assign: wire.Assign, slot: int) -> tuple[ChunkStream | None, Noted | None]:
        """Where a streamed request's text goes, with the log-probabilities of its tokens when asked for (None
        if the request is not streamed), and with ``report_tokens`` the ids of the tokens the engine gave, which
        on_token notes (while the sequence runs: its last text may go out after it ended): each CHUNK carries
        those noted since the last one (their text is in it, or held back by the engine), so the broker can
        resume the request elsewhere."""
        if not assign.request.stream:
            return None, None
        request_id, ticket, engine, index = assign.request.id, assign.ticket, self._engine, assign.index
        assert engine is not None
        said = self._said.setdefault(ticket, offers.Said())  # a resumed sequence's goes on
        if not assign.report_tokens:
            def send_text(text: str) -> None:
                said.add(text)
                self._queue(wire.MsgType.CHUNK, ticket, wire.pack(wire.Chunk(
                    request_id, text, engine.take_logprobs(slot), index)), None)

            return ChunkStream(send_text, self._spec.stream_interval), None
        noted = Noted(lambda: engine.tokens(slot))

        def send(text: str) -> None:
            said.add(text, ids := noted.take())
            self._queue(wire.MsgType.CHUNK, ticket, wire.pack(wire.Chunk(request_id, text, engine.take_logprobs(slot),
                                                                         index)), wire.token_frame(ids))

        return ChunkStream(send, self._spec.stream_interval), noted

    # --- stepping -----------------------------------------------------------------------------------

    def _step(self) -> None:
        engine = self._engine
        assert engine is not None
        if self._permits is not None and self._permit is None:
            try:
                self._permit = self._permits.acquire(stop=self._nothing_left)
            except Cancelled:  # all were cancelled while queueing (the step below only ends them), or it leaves
                if self._leaving_now():
                    return
            else:
                for ticket in self._running:
                    self._rows[self._slot_of[ticket]].update(state=SlotState.BUSY)
        try:
            finished = engine.step()
        except Exception:  # a llama.cpp failure leaves the context in doubt: fail what runs, and restart
            log.exception("a step failed; ending %d request(s) and restarting", len(self._running))
            for ticket in list(self._running):
                self._end(ticket, wire.Error(self._running[ticket].request.id, ErrorCode.INTERNAL,
                                             "the batch step failed"))
            self._flush()
            sys.exit(1)
        by_slot = {slot: ticket for ticket, slot in self._slot_of.items()}
        ended = [(by_slot[slot], completion) for slot, completion in finished]
        if self._permit is not None and len(ended) == len(self._running):
            # The last sequences end: the permit goes back before their answers, so a client holding its
            # answer finds the device free and the hold logged, as it finds the slot idle.
            self._permit.release()
            self._permit = None
        for ticket, completion in ended:
            self._end(ticket, self._reply(self._running[ticket], completion))
        self._flush()

    def _nothing_left(self) -> bool:
        """While queueing for the permit: stop waiting once every running request was cancelled."""
        self._pump()
        return self._leaving_now() or all(t in self._cancelled_tickets for t in self._running)

    def _end(self, ticket: str, outcome: wire.Done | wire.Error) -> None:
        """Answer a request that ended. The row says idle before the reply goes out: a client holding its
        answer sees the slot free. Streamed text still gathered goes before DONE (the client reads it first)."""
        assign = self._running.pop(ticket)
        self._cancelled_tickets.discard(ticket)
        slot = self._slot_of.pop(ticket)
        self._noted.pop(ticket, None)
        said = self._said.pop(ticket, None)
        whole = ticket not in self._taken_over  # its text all streamed from here
        self._taken_over.discard(ticket)
        self._served += 1
        if self._spans is not None:
            self._spans.dropped(ticket)
        self._rows[slot].update(state=SlotState.IDLE, served=self._served,
                                kv_cells=self._engine.kv_cells(slot) if self._engine is not None else 0)
        stream = self._streams.pop(ticket, None)
        if stream is not None and isinstance(outcome, wire.Done):
            stream.flush()
        body = self._answer(outcome, assign.ticket)
        if whole:
            self._sent.note(assign, said, outcome.TYPE, body)

    def _reply(self, assign: wire.Assign, result: Completion) -> wire.Done | wire.Error:
        outcome = answer(assign, result, self._spec.identity.decode())
        if self._spans is not None and isinstance(outcome, wire.Done):
            self._spans.answered(assign, result)
        return outcome

