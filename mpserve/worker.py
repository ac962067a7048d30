"""A worker process: one engine, connected to the broker by a DEALER.

    broker --ASSIGN/CANCEL/STOP--> worker --READY/FAILED, then CHUNK*/DONE|ERROR per ticket--> broker

The worker is started by the supervisor from a clean interpreter (multiprocessing "spawn"), sets
CUDA_VISIBLE_DEVICES before llama_cpp is imported, writes its own slot-table rows, and exits when told
to stop, when its model cannot be loaded (after sending FAILED), or when its parent (the server) is gone.
``Worker`` holds what every worker does (registration, heartbeats, permits, idle unloading, replies) and
serves the echo backend one request at a time, checking for a CANCEL after every piece; a model is served
by ``BatchWorker`` (batch_worker.py), ``parallel`` requests at once, 1 by default.

A streamed request's text goes out as CHUNKs: its first piece at once, later ones gathered and sent at
most every ``stream_interval`` seconds, the rest just before DONE. Every message costs CPU in three
processes (worker, broker, client) on cores that llama.cpp's threads are using; gathering the pieces a
few steps produce keeps that cost from growing with the token rate (0 sends every token on its own).
"""

from __future__ import annotations

import logging
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

from . import protocol as wire
from .chat_template import ChatTemplate
from .engine import Completion, EchoEngine, EngineSpec, OnToken
from .errors import MpserveError
from .permits import DevicePermits, HoldLog
from .slots import SlotState, SlotTable, SlotWriter

log = logging.getLogger("mpserve.worker")

PARENT_CHECK_S = 1.0
REGISTER_BACKOFF_FIRST_S = 0.5
REGISTER_BACKOFF_MAX_S = 5.0
EXIT_LOAD_FAILED = 3


@dataclass(frozen=True)
class PermitSpec:
    """The GPU permit a worker holds while it computes: host-wide, ``capacity`` holders at once."""

    device_key: str
    capacity: int
    lock_dir: str | None = None
    hold_log: str | None = None  # append each hold interval here


@dataclass(frozen=True)
class WorkerSpec:
    index: int
    model: str
    engine: EngineSpec
    device: int  # -1: CPU
    backend: str  # the broker's worker-socket address
    slots_path: str
    parent_pid: int
    idle_timeout: float = 0.0  # unload after this long without a request; 0: never
    lazy: bool = False  # start without loading the model (single active backend: the broker decides)
    permit: PermitSpec | None = None
    pool: str = ""  # a remote pool's name ("host-pid"); "" for the broker's own workers
    curve_server_key: str | None = None  # remote pools: the broker's public key file ...
    curve_secret: str | None = None  # ... and this pool's secret key file
    heartbeat_interval: float = 1.0
    heartbeat_liveness: int = 5
    first_row: int = 0  # its slot-table rows: first_row .. first_row + engine.parallel - 1
    log_level: str = "info"
    stream_interval: float = 0.0  # seconds between a streamed request's CHUNKs after its first; 0: every token

    @property
    def rows(self) -> range:
        return range(self.first_row, self.first_row + self.engine.parallel)

    @property
    def identity(self) -> bytes:
        return f"{self.pool}-w{self.index}".encode() if self.pool else f"w{self.index}".encode()

    @property
    def host(self) -> str:
        return self.pool.rsplit("-", 1)[0] if self.pool else ""


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of the spawned process."""
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the order NVML and nvidia-smi number devices in
    os.environ["CUDA_VISIBLE_DEVICES"] = str(spec.device) if spec.device >= 0 else ""
    os.setsid()  # out of the server's process group: Ctrl-C or a group-wide SIGTERM reaches the server,
    # which finishes requests and then stops its workers; a worker notices a dead server by itself.
    logging.basicConfig(level=spec.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s worker {spec.index} ({spec.model}): %(message)s")
    table = SlotTable.attach(spec.slots_path)
    rows = [table.writer(row) for row in spec.rows]
    for row in rows:
        row.update(pid=os.getpid(), state=SlotState.STARTING, request="", tokens=0, served=0, started=time.time())
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, spec.identity)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)  # ZeroMQ reconnects by itself, backing off up to 5 s
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
    if spec.curve_server_key and spec.curve_secret:
        sock.curve_serverkey = zmq.auth.load_certificate(spec.curve_server_key)[0]
        sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(spec.curve_secret)
    sock.connect(spec.backend)
    permits = None
    try:
        if spec.permit is not None:
            hold_log = HoldLog(Path(spec.permit.hold_log)) if spec.permit.hold_log else None
            permits = DevicePermits(spec.permit.device_key, spec.permit.capacity,
                                    Path(spec.permit.lock_dir) if spec.permit.lock_dir else None, on_hold=hold_log)
        if spec.engine.is_echo:
            worker = Worker(spec, sock, rows, permits)
        else:  # imports llama_cpp, now that CUDA_VISIBLE_DEVICES is set
            from .batch_worker import BatchWorker

            worker = BatchWorker(spec, sock, rows, permits)
        if spec.lazy:
            worker.set_rows(state=SlotState.UNLOADED)
        else:
            worker.load()
        worker.run()
    finally:
        if permits is not None:
            permits.close()
        sock.close()
        ctx.term()
        table.close()


class Worker:
    """Serves the echo backend, one request at a time; ``BatchWorker`` serves models."""

    def __init__(self, spec: WorkerSpec, sock: zmq.Socket, rows: list[SlotWriter],
                 permits: DevicePermits | None = None) -> None:
        self._spec = spec
        self._permits = permits
        self._engine: Any = None
        self._sock = sock
        self._rows = rows
        self._row = rows[0]
        self._served = 0
        self._stopping = False
        self._current: wire.Assign | None = None
        self._cancelled = False
        self._next_parent_check = 0.0
        self._next_heartbeat = 0.0
        self._heard = time.monotonic()
        self._must_register = False
        self._register_backoff = REGISTER_BACKOFF_FIRST_S
        self._next_register = 0.0
        self._registered = False

    def set_rows(self, **fields: Any) -> None:
        for row in self._rows:
            row.update(**fields)

    def load(self) -> None:
        """Load the model; on failure tell the broker why (FAILED) and exit for the supervisor to decide."""
        self.set_rows(state=SlotState.LOADING)
        t0 = time.perf_counter()
        try:
            self._engine = self._build_engine()
        except Exception as exc:  # any load failure is reported the same way
            log.error("cannot load %s: %s", self._spec.engine.path, exc)
            self.set_rows(state=SlotState.FAILED)
            self._send(wire.Failed(self._spec.identity.decode(), self._spec.model, f"{type(exc).__name__}: {exc}"))
            sys.exit(EXIT_LOAD_FAILED)
        self.set_rows(state=SlotState.IDLE, load_s=time.perf_counter() - t0)
        log.debug("loaded in %.2f s", time.perf_counter() - t0)
        if self._registered:  # loaded on demand: tell the broker (its chat template, and that the load worked)
            self._register()

    def _build_engine(self) -> Any:
        return EchoEngine()

    @property
    def _busy(self) -> bool:
        return self._current is not None

    def run(self) -> None:
        spec = self._spec
        self._register()
        idle_since = time.monotonic()
        while not self._stopping:
            if self._sock.poll(int(min(PARENT_CHECK_S, spec.heartbeat_interval) * 1000)):
                msg = self._receive()
                if isinstance(msg, wire.Assign):
                    self._serve(msg)
                    idle_since = time.monotonic()
            self._keep_alive()
            if self._engine is not None and spec.idle_timeout and time.monotonic() - idle_since >= spec.idle_timeout:
                log.info("idle for %.0f s; unloading the model until the next request", spec.idle_timeout)
                self._unload()
        self._row.update(state=SlotState.STOPPING)

    def _register(self) -> None:
        spec = self._spec
        chat = self._engine.chat if self._engine is not None else ChatTemplate()
        self._send(wire.Ready(spec.identity.decode(), spec.model, spec.device, spec.engine.parallel, os.getpid(),
                              loaded=self._engine is not None, host=spec.host, chat_template=chat.template,
                              bos_token=chat.bos_token, eos_token=chat.eos_token))
        self._registered = True
        self._must_register = False
        self._heard = time.monotonic()  # give the broker a full expiry to answer before trying again

    def _keep_alive(self) -> None:
        """Heartbeats both ways (the Paranoid Pirate pattern): send one every interval; if the broker has
        been silent for interval × liveness, register again, backing off with jitter, so that a broker
        that restarted or declared this worker lost gets it back. Also: exit if the server is gone."""
        spec = self._spec
        now = time.monotonic()
        if now >= self._next_parent_check:
            self._next_parent_check = now + PARENT_CHECK_S
            if os.getppid() != spec.parent_pid:
                log.warning("server (pid %d) is gone; exiting", spec.parent_pid)
                self._stopping = True
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + spec.heartbeat_interval
            self._send(wire.Heartbeat(spec.identity.decode()))
        silent = now - self._heard > spec.heartbeat_interval * spec.heartbeat_liveness
        if not self._busy and (self._must_register or (silent and now >= self._next_register)):
            if silent:
                log.warning("no word from the broker for %.1f s; registering again", now - self._heard)
            self._register()
            self._register_backoff = min(REGISTER_BACKOFF_MAX_S, self._register_backoff * 2)
            self._next_register = now + self._register_backoff * random.uniform(0.5, 1.5)

    def _unload(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        self.set_rows(state=SlotState.UNLOADED)
        self._send(wire.Unloaded(self._spec.identity.decode()))

    def _receive(self) -> wire.Assign | None:
        """Take one broker message; handle CANCEL/STOP here, return an ASSIGN for the caller."""
        frames = self._sock.recv_multipart()
        self._heard = time.monotonic()
        self._register_backoff = REGISTER_BACKOFF_FIRST_S
        try:
            msg = wire.decode(frames)
        except MpserveError as exc:
            log.error("dropped a bad message from the broker: %s", exc)
            return None
        if isinstance(msg, wire.Heartbeat) and not msg.registered:
            self._must_register = True  # the broker does not know this worker (any more)
            self._void_running()  # the tickets of running requests are void
        elif isinstance(msg, wire.Error):
            log.error("the broker refused this worker: %s", msg.message)
            sys.exit(EXIT_LOAD_FAILED)
        elif isinstance(msg, wire.Stop):
            self._stopping = True
        elif isinstance(msg, wire.Unload):
            if not self._busy:
                self._unload()
            else:  # the broker unloads only idle workers; say so rather than drop a running request
                log.error("asked to unload while serving; ignored")
        elif isinstance(msg, wire.Cancel):
            self._cancel(msg.id)
        elif isinstance(msg, wire.Assign):
            return self._accept(msg)
        return None

    def _void_running(self) -> None:
        self._cancelled = self._current is not None

    def _cancel(self, ticket: str) -> None:
        if self._current is not None and ticket == self._current.ticket:
            self._cancelled = True

    def _accept(self, assign: wire.Assign) -> wire.Assign | None:
        """An ASSIGN to serve now (returned to the run loop), or refused."""
        if self._current is None:
            return assign
        self._send(wire.Error(assign.request.id, "internal", "worker was given a request while busy"), assign.ticket)
        return None

    def _serve(self, assign: wire.Assign) -> None:
        req = assign.request
        if self._engine is None:  # unloaded by the idle watchdog: the request waits for the load
            self.load()
        assert self._engine is not None
        self._current, self._cancelled = assign, False
        self._row.update(state=SlotState.BUSY, request=req.id, tokens=0)
        stream = self._stream(assign)

        def on_token(text: str, tokens: int) -> bool:
            self._row.progress(tokens)
            if stream is not None and text:
                stream.push(text)
            return not self._should_stop()

        outcome = self._outcome(assign, on_token)
        self._served += 1
        self._current = None
        # The row says idle before the reply goes out: a client holding its answer sees the slot free.
        self._row.update(state=SlotState.IDLE, served=self._served)
        self._answer(assign, outcome, stream)

    def _stream(self, assign: wire.Assign) -> ChunkStream | None:
        """Where a streamed request's text goes; None if the request is not streamed."""
        if not assign.request.stream:
            return None
        request_id, ticket = assign.request.id, assign.ticket
        return ChunkStream(lambda text: self._send(wire.Chunk(request_id, text), ticket), self._spec.stream_interval)

    def _answer(self, assign: wire.Assign, outcome: wire.Done | wire.Error, stream: ChunkStream | None) -> None:
        """The terminal message, after the streamed text still gathered (the client reads it first)."""
        if stream is not None and isinstance(outcome, wire.Done):
            stream.flush()
        self._send(outcome, assign.ticket)

    def _outcome(self, assign: wire.Assign, on_token: OnToken) -> wire.Done | wire.Error:
        """Run the request; its terminal message, whatever happens."""
        req = assign.request
        try:
            result = self._compute(req, on_token)
        except MpserveError as exc:
            return wire.Error(req.id, exc.code, exc.message)
        except Exception as exc:  # a bug or a llama.cpp failure: report it; the request must end
            log.exception("request %s failed", req.id)
            return wire.Error(req.id, "internal", f"{type(exc).__name__}: {exc}")
        return self._reply(assign, result)

    def _reply(self, assign: wire.Assign, result: Completion) -> wire.Done | wire.Error:
        req = assign.request
        if result.finish_reason == "cancelled":
            return wire.Error(req.id, "cancelled", "cancelled")
        return wire.Done(
            req.id, result.text, result.finish_reason, wire.Usage(result.prompt_tokens, result.completion_tokens),
            wire.Timings(assign.queue_ms, result.prompt_s * 1000, result.generate_s * 1000, assign.attempt,
                         cached_tokens=getattr(result, "reused_tokens", 0)),
            worker=self._spec.identity.decode(),
        )

    def _compute(self, req: wire.Request, on_token: OnToken) -> Completion:
        """Generate while holding the device's permit, from the first prompt token to the last token."""
        assert self._engine is not None
        if self._permits is None:
            return self._engine.generate(req.prompt, req.params, on_token)
        self._row.update(state=SlotState.WAITING)
        with self._permits.acquire(stop=self._should_stop):
            self._row.update(state=SlotState.BUSY)
            return self._engine.generate(req.prompt, req.params, on_token)

    def _should_stop(self) -> bool:
        self._pump()
        return self._cancelled or self._stopping

    def _pump(self) -> None:
        """Between tokens (or permit polls): take what the broker sent, and keep the link alive."""
        while self._sock.poll(0):
            self._receive()
        self._keep_alive()

    def _send(self, msg: object, ticket: str = "") -> None:
        self._sock.send_multipart(wire.encode_from_worker(msg, ticket))


class ChunkStream:
    """One streamed request's text on its way out: the first piece is sent at once; later pieces are
    gathered and sent together once ``interval`` seconds have passed since the last send; ``flush``
    sends what is left. The concatenated chunks are always the whole text."""

    __slots__ = ("_send", "_interval", "_parts", "_sent_at")

    def __init__(self, send: Callable[[str], None], interval: float) -> None:
        self._send = send
        self._interval = interval
        self._parts: list[str] = []
        self._sent_at = -interval  # the first piece goes at once

    def push(self, text: str) -> None:
        self._parts.append(text)
        now = time.monotonic()
        if now - self._sent_at >= self._interval:
            self._sent_at = now
            self.flush()

    def flush(self) -> None:
        if self._parts:
            text = "".join(self._parts)
            self._parts.clear()
            self._send(text)
