"""The workers' side of the broker: who may register (READY and trust), what their messages are, and what becomes
of the requests of a worker that dies, stalls or is lost.

    worker message ─▶ message ─▶ not registered: READY ─▶ register, or refused · FAILED proving a local worker:
                                 hooks.load_failed · HEARTBEAT: asked to register · anything else: dropped, counted
                                 (``dropped_unregistered``)
                    registered ─▶ a lookup's answer (to its client) · an adapter call's (``AdapterOps``) · STEP and
                                 results (``Results``) · FAILED · LEAVING (worker_gone, a hand-over) · UNLOADED
    register ─▶ ``link``: whose proof (this start's secret, or an adoptee's: ``Adopter``), which name; a remote
                pool's key (``pool_keys``) and chat template (``chat``) ─▶ a WorkerEntry, its slots free ─▶ an adoptee
                adopted · hooks.worker_ready · the adapters loaded at run time sent · the dispatcher
    worker_gone (exit, stall, silence, LEAVING, a new process under its name) ─▶ its lookups and adapter calls end,
        each request it ran settled by ``routing.after_loss``: queued again first in line (from its streamed tokens,
        if any), or ended poison_request / worker_lost / model_failed

How a worker ended decides what the loss counts as (``routing``: crash or hand-over):

    local worker ──exit status──▶ crash signal (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) ─▶ a crash of each
                                  request it ran, and of its model (``_model_crashed``)
                                  anything else (SIGKILL, SIGTERM, an exit code) ─▶ a hand-over
    stalled (watchdog) ─────────▶ a crash of each request it ran (not of its model)
    remote worker silent, or a new process under a lost one's name ─▶ a hand-over
    a worker's LEAVING (told to stop, terminated, its server or pool gone) ─▶ a hand-over, at once

A request that has now crashed two workers is failed with ``poison_request``; one that has been handed over
MAX_HANDOVERS times, with ``worker_lost`` naming that bound. A model whose workers crashed on MODEL_CRASHES
different requests in a row is failed (``model_failed``), its requests with it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from signal import Signals

from mpserve.errors import ErrorCode, MpserveError
from mpserve.wire import protocol as wire
from mpserve.wire.protocol import ChatTemplate

from . import chat, link, pool_keys, spans
from .adapter_ops import AdapterOps
from .adopter import Adopter
from .answers import Answers
from .clients import Clients
from .dispatch import Dispatcher
from .hooks import BrokerHooks
from .pool_keys import PoolKey
from .results import Results
from .routing import MAX_HANDOVERS, MODEL_CRASHES, AfterLoss, after_loss, crash_signal, crash_streak, describe_exit
from .state import Lost, ModelQueue, Pending, RequestState, WorkerEntry
from .tables import Tables, WorkerOutbox

log = logging.getLogger("mpserve.broker")

TRAILED = {wire.TYPE_FRAMES[t] for t in (wire.MsgType.CHUNK, wire.MsgType.DONE, wire.MsgType.ERROR, wire.MsgType.READY,
                                         wire.MsgType.PARKED)}  # may have a 5th frame
LOOKUP_ANSWERS = {wire.MsgType.TOKENS, wire.MsgType.EMBEDDINGS, wire.MsgType.SLOT_REPLY, wire.MsgType.ERROR}
UNREGISTERED_LOG_S = 10.0  # messages from peers not registered are counted each, logged at most this often


class Registry:
    """The registered workers: their messages, their trust, and their loss."""

    def __init__(self, tables: Tables, results: Results, clients: Clients, hooks: BrokerHooks, *,
                 pool_keys: dict[str, PoolKey], expiry: float) -> None:
        """``pool_keys``: the remote pools' keys whose models are limited; ``expiry``: how long a remote worker may
        be silent before it is lost."""
        self.tables = tables
        self.results = results
        self.clients = clients
        self.dispatcher: Dispatcher = clients.dispatcher
        self.answers: Answers = clients.answers
        self.outbox: WorkerOutbox = clients.outbox
        self.adopter: Adopter = clients.adopter
        self.adapter_ops: AdapterOps = clients.adapter_ops
        self.hooks = hooks
        self.pool_keys = pool_keys
        self.expiry = expiry
        self._unregistered_logged = -UNREGISTERED_LOG_S  # when a message from an unregistered peer was last logged

    def message(self, frames: list[bytes], key: str = "") -> None:
        """One message on the worker socket (``key``: the CURVE key its peer proved, when the keys' models are
        limited). One that raises is logged, counted and dropped: the broker serves on (a bug, or a message no
        check foresaw, costs that message, not the server)."""
        try:
            self._message(frames, key)
        except Exception:
            self.tables.stats["worker_message_failed"] += 1
            log.exception("internal error while handling a message from worker %r; dropped it", frames[0])

    def _message(self, frames: list[bytes], key: str) -> None:
        if len(frames) < 2:
            self.tables.stats["dropped_worker_malformed"] += 1
            return
        identity, frames = frames[0], frames[1:]
        entry = self.tables.workers.get(identity)
        if entry is not None:
            entry.last_heard = time.monotonic()
            entry.unreachable = False
        try:  # a fifth frame: a CHUNK's tokens, a DONE's or ERROR's host store changes, a READY's whole store
            mtype = wire.parse_header(frames, 5 if len(frames) == 5 and frames[1] in TRAILED else 4)
        except MpserveError as exc:
            self.tables.stats["dropped_worker_malformed"] += 1
            log.warning("refused a message from worker %r: %s", identity, exc)
            self.outbox.to_worker(identity, wire.Error(None, exc.code, f"refused by the broker: {exc.message}"))
            return
        if entry is None and mtype is not wire.MsgType.READY:
            self._from_unregistered(identity, mtype, frames[3])
            return
        if frames[2] and self._lookup_answered(identity, mtype, frames[2].decode(errors="replace"), frames[3]):
            return
        if frames[2] and self.adapter_ops.answered(identity, mtype, frames[2].decode(errors="replace"), frames[3]):
            return
        if mtype is wire.MsgType.STEP:
            self.results.step(identity, frames[3])
            return
        if mtype in wire.STEPPED:
            self.results.result(identity, mtype, frames[2].decode(errors="replace"), frames[1], frames[3],
                                frames[4] if len(frames) == 5 else None)
            return
        if mtype in LOOKUP_ANSWERS:  # for a lookup no longer here (its client went, its worker was lost)
            self.tables.stats["dropped_stale_result"] += 1
            return
        try:
            msg = wire.decode_body(mtype, frames[3])
        except MpserveError as exc:
            self.tables.stats["dropped_worker_malformed"] += 1
            log.error("dropped a bad %s from worker %r: %s", mtype.name, identity, exc)
            return
        if isinstance(msg, wire.Ready):
            self.register(identity, msg, frames[4] if len(frames) == 5 else None, key)
            return
        assert entry is not None
        if isinstance(msg, wire.Failed):
            self._load_failed(entry, msg.message)
        elif isinstance(msg, wire.Leaving):
            self._worker_left(entry, msg.reason)
        elif isinstance(msg, wire.Unloaded):
            entry.loaded = entry.unloading = False
            entry.prompts.clear()  # its KV cells went with the model; the host store keeps its entries
            self.dispatcher.unpin(entry)
            self.dispatcher.dispatch(entry.model)

    def _from_unregistered(self, identity: bytes, mtype: wire.MsgType, body: bytes) -> None:
        """A message from a peer that is not a registered worker: nothing of it is acted on, but a FAILED that
        proves it comes from one of the server's own workers (which fail to load before they register). A
        HEARTBEAT or UNLOADED is a worker that was lost, or registered with the broker before this one: it is
        asked to register; anything else is dropped, counted (``dropped_unregistered``) and logged."""
        if mtype is wire.MsgType.FAILED and self._local_load_failed(identity, body):
            return
        if mtype in (wire.MsgType.HEARTBEAT, wire.MsgType.UNLOADED):
            self.outbox.to_worker(identity, wire.Heartbeat(identity.decode(errors="replace"), registered=False))
            return
        if mtype is wire.MsgType.LEAVING:  # a worker this broker had already forgotten
            return
        self.tables.stats["dropped_unregistered"] += 1
        now = time.monotonic()
        if now - self._unregistered_logged >= UNREGISTERED_LOG_S:
            self._unregistered_logged = now
            log.warning("dropped a %s from %r, which is not a registered worker (%d such messages so far; said at "
                        "most every %.0f s)", mtype.name, identity, self.tables.stats["dropped_unregistered"],
                        UNREGISTERED_LOG_S)

    def _local_load_failed(self, identity: bytes, body: bytes) -> bool:
        """Whether ``body`` is the FAILED of one of the server's own workers (``link.local_index``): its supervisor
        is told."""
        try:
            failed = wire.decode_body(wire.MsgType.FAILED, body)
        except MpserveError:
            return False
        assert isinstance(failed, wire.Failed)
        index = link.local_index(identity, failed, self.adopter.secrets_of(identity))
        if index is not None:
            self.hooks.load_failed(index, failed.message)
        return index is not None

    def _lookup_answered(self, identity: bytes, mtype: wire.MsgType, ticket: str, body: bytes) -> bool:
        """Whether the message answered a lookup (TOKENIZE, EMBED, SLOT_ACTION): its answer (TOKENS, EMBEDDINGS,
        SLOT_REPLY or ERROR) goes to its client, taken only from the worker the lookup was sent to; an answer of
        another type, or from another worker, under a lookup's ticket is dropped and counted, and the lookup
        still waits for its worker."""
        lookup = self.tables.lookups.get(ticket)
        if lookup is None:
            return False
        client, _, worker = lookup
        if worker != identity or mtype not in LOOKUP_ANSWERS:
            self.tables.stats["dropped_foreign_lookup_answer"] += 1
            log.error("dropped a %s from worker %r under the ticket of a lookup sent to %r", mtype.name, identity,
                      worker)
            return True
        del self.tables.lookups[ticket]
        self.answers.to_client(client, [wire.VERSION, wire.TYPE_FRAMES[mtype], body])
        return True

    def _load_failed(self, entry: WorkerEntry, message: str) -> None:
        """A registered worker could not load its model (on demand): a local one's supervisor counts it; a remote
        one's pool does (it is said in the log)."""
        if entry.index is not None:
            self.hooks.load_failed(entry.index, message)
        else:
            log.error("worker %r on %s could not load %s: %s", entry.identity, entry.host, entry.model, message)

    # --- registration ----------------------------------------------------------------------------

    def register(self, identity: bytes, msg: wire.Ready, cache: bytes | None, key: str = "") -> None:
        """A worker registered (again): ``cache`` is its whole host store's CACHE frame, if it holds any; ``key``
        the CURVE key it connected with (``pool_keys``: which models it may serve)."""
        if msg.protocol not in (wire.WORKER_LINK, wire.PREVIOUS_LINK):
            log.error("worker %r on %s speaks the worker protocol %r, this broker %r; refused (run the same mpserve "
                      "version on the pool's host)", identity, msg.host or "this host", msg.protocol, wire.WORKER_LINK)
            self.outbox.to_worker(identity, wire.Error(None, ErrorCode.PROTOCOL, (
                f"this broker speaks the worker protocol {wire.WORKER_LINK}, not {msg.protocol}: install the "
                "server's mpserve version on this host")))
            return
        if msg.model not in self.tables.models:
            log.error("worker %r registered for model %r, which this broker does not serve (%s); ignored",
                      identity, msg.model, ", ".join(self.tables.models))
            self.outbox.to_worker(identity, wire.Error(None, ErrorCode.UNKNOWN_MODEL,
                                                       f"this broker does not serve {msg.model!r}"))
            return
        old = self.tables.workers.get(identity)
        if old is not None and old.pid == msg.pid and old.model == msg.model:
            # the same process registering again: it had not heard from us, or it loaded its model on demand,
            # which the supervisor counts as a good load (its model's failed loads start afresh), or it answers
            # a HAND_OFF
            self.tables.handing.discard(identity)
            self._take_chat(identity, msg, old.index is not None)
            self._cache_held(old, cache)
            if msg.loaded and old.index is not None:
                old.loaded = True
                self.hooks.worker_ready(old)
            return
        index = link.local_index(identity, msg, self.adopter.secrets_of(identity))
        refused = (link.refusal(identity, msg, index, old)
                   or (pool_keys.refusal(self.pool_keys.get(key), msg.model) if index is None else None)
                   or self._chat_refusal(msg, index is not None))
        if refused is not None:
            self.tables.stats["refused_worker_ready"] += 1
            log.error("refused a READY from %r (pid %d, host %r): %s", identity, msg.pid, msg.host, refused)
            self.outbox.to_worker(identity, wire.Error(None, ErrorCode.PROTOCOL, f"refused by the broker: {refused}"))
            return
        if index is None and not self._heard_back(identity, msg):
            return
        if old is not None:  # a new process under the same name: whatever the old one ran is lost
            self.worker_gone(old, f"worker {identity.decode()} restarted", crashed=False)
        local = index is not None
        self._take_chat(identity, msg, local)
        entry = WorkerEntry(identity, index, msg.model, msg.device, msg.capacity,
                            msg.pid, msg.loaded, host=msg.host, last_heard=time.monotonic(),
                            ram=self.tables.models[msg.model].store(msg.host), adapters=frozenset(msg.adapters),
                            code=f"{msg.version} {msg.protocol}", engine=msg.engine)
        self.tables.workers[identity] = entry
        self._cache_held(entry, cache)
        mq = self.tables.models[msg.model]
        mq.instances += 1
        mq.free.extend((identity, slot) for slot in range(msg.capacity))
        if local and identity in self.adopter.adoptions.expected and self.adopter.adopt(entry, msg.live):
            self.clients.release_held()  # the last adoptee expected: the requests held for them go on
        if local:
            self.hooks.worker_ready(entry)
        else:
            log.info("worker %s on %s registered for %s", identity.decode(), msg.host, msg.model)
        self.adapter_ops.registered(entry)
        self.dispatcher.dispatch(msg.model)

    def _heard_back(self, identity: bytes, msg: wire.Ready) -> bool:
        """Answer a remote worker's READY at once (a heartbeat), so that it hears the broker before its silence
        makes it connect again. Whether it could: a READY that came over a connection already closing registers
        nothing. A remote worker outlives brokers: one that connected again while a restarted broker was not
        reading yet (starting) left such a connection, its READY unread, and ZeroMQ refused the new connection the
        name the old one still held. Registered, the worker would be unreachable and each request sent to it
        handed over; unanswered, it hears nothing, and connects and registers again."""
        if self.outbox.send(identity, wire.encode(wire.Heartbeat(identity.decode()))):
            return True
        self.tables.stats["unanswered_ready"] += 1
        log.warning("worker %s%s: its READY came over a connection that is closing; not registered until it "
                    "registers again", identity.decode(), f" on {msg.host}" if msg.host else "")
        return False

    def _chat_verdict(self, msg: wire.Ready, local: bool) -> chat.Verdict:
        mq = self.tables.models[msg.model]
        return chat.judge(chat.Held(mq.chat, mq.chat_local), self.tables.chat_templates.get(msg.model),
                          ChatTemplate(msg.chat_template, msg.bos_token, msg.eos_token), local)

    def _chat_refusal(self, msg: wire.Ready, local: bool) -> str | None:
        """Why a remote pool's READY may not register: its chat template differs from the model's
        (``mpserve.server.chat``)."""
        if local or self._chat_verdict(msg, local) is not chat.Verdict.DIFFERS:
            return None
        mq = self.tables.models[msg.model]
        return chat.differs(msg.model, chat.Held(mq.chat, mq.chat_local))

    def _take_chat(self, identity: bytes, msg: wire.Ready, local: bool) -> None:
        """The template a registering worker brings: taken (a local instance's first, or a pool's that is the
        server's own while none is known), or, if it differs from the model's, logged and counted, never taken."""
        verdict = self._chat_verdict(msg, local)
        mq = self.tables.models[msg.model]
        if verdict is chat.Verdict.TAKE:
            mq.chat, mq.chat_local = ChatTemplate(msg.chat_template, msg.bos_token, msg.eos_token), local
        elif verdict is chat.Verdict.DIFFERS:
            self.tables.stats["chat_template_differs"] += 1
            log.warning("worker %r%s serves model %s with another chat template (or BOS or EOS token text) than the "
                        "one the server hands out; kept that one", identity, f" on {msg.host}" if msg.host else "",
                        msg.model)

    def _cache_held(self, entry: WorkerEntry, frame: bytes | None) -> None:
        """A READY's CACHE frame, or none: what the worker's host store holds (added to what other instances on
        that host told: the view is the host's)."""
        if frame is not None:
            self.results.cache_changed(entry, frame)

    # --- loss and retry --------------------------------------------------------------------------

    def worker_stalled(self, index: int, silent_s: float) -> None:
        """The supervisor is about to kill a worker that stopped making progress: its requests go elsewhere
        now, by the rules of a worker that crashed (a request can hang an engine as it can crash one: one that
        stalls or crashes two workers is poison). A stall does not count toward its model's crashes: it names
        no signal, and a host short of CPU stalls healthy workers."""
        entry = self.tables.worker_at(index)
        if entry is not None:
            self.worker_gone(entry, f"worker {index} produced no token for {silent_s:.1f} s", crashed=True)
        self.outbox.flush()

    def worker_exited(self, index: int, code: int | None) -> None:
        """The supervisor reaped local worker ``index``, which ended with exit status ``code`` (negative: the
        signal that ended it). A crash signal (``routing.crash_signal``) is a crash of the requests it ran, and
        of its model (``_model_crashed``); any other end hands them over."""
        entry = self.tables.worker_at(index)
        if entry is not None:
            sig = crash_signal(code)
            if sig is not None:
                self._model_crashed(entry, sig)
            self.worker_gone(entry, f"worker {index} exited with {describe_exit(code)}", crashed=sig is not None)
        self.outbox.flush()

    def expire(self, now: float) -> None:
        """Declare lost the remote workers silent for longer than the heartbeat expiry, and those an ASSIGN could
        not be sent to: its request never reached them, and one that talks again on a new link (it reconnected
        and registers again, as the same process) would otherwise hold it unanswered for good."""
        # a hand-over below may add to the next turn's
        undelivered, self.outbox.undelivered = self.outbox.undelivered, set()
        for identity in undelivered:
            entry = self.tables.workers.get(identity)
            if entry is not None and entry.index is None:
                self.tables.stats["worker_link_down"] += 1
                log.warning("worker %s on %s: a request could not be sent to it; declared lost, its requests go "
                            "elsewhere", identity.decode(), entry.host)
                self.worker_gone(entry, f"the link to worker {identity.decode()} on {entry.host} went down",
                                 crashed=False)
        for entry in [w for w in self.tables.workers.values() if w.index is None and now - w.last_heard > self.expiry]:
            self.tables.stats["worker_expired"] += 1
            log.warning("worker %s on %s sent nothing for %.1f s; declared lost", entry.identity.decode(),
                        entry.host, now - entry.last_heard)
            self.worker_gone(entry, f"worker {entry.identity.decode()} on {entry.host} was lost", crashed=False)
        self.outbox.flush()

    def _worker_left(self, entry: WorkerEntry, reason: str) -> None:
        """A worker said it is exiting (LEAVING): it is forgotten now, not after its silence or its reaping, and
        the requests it ran are handed over."""
        self.tables.stats["worker_left"] += 1
        where = f" on {entry.host}" if entry.index is None else ""
        log.info("worker %s%s is leaving (%s)%s", entry.identity.decode(), where, reason,
                 f"; handing over {len(entry.running)} request(s)" if entry.running else "")
        self.worker_gone(entry, f"worker {entry.identity.decode()}{where} stopped ({reason})", crashed=False)

    def _forget_worker(self, entry: WorkerEntry) -> None:
        if self.tables.workers.get(entry.identity) is not entry:
            return
        del self.tables.workers[entry.identity]
        self.outbox.assigns.pop(entry.identity, None)  # their requests are settled by the caller, by the retry rules
        mq = self.tables.models[entry.model]
        mq.instances -= 1
        mq.free = deque(f for f in mq.free if f[0] != entry.identity)
        self.dispatcher.unpin(entry)

    def worker_gone(self, entry: WorkerEntry, what: str, crashed: bool) -> None:
        """A worker died, stalled or was lost: settle its requests by the rules, each counting a crash if
        ``crashed``, else a hand-over."""
        self._forget_worker(entry)
        if self.tables.models[entry.model].instances == 0:
            self.tables.models[entry.model].lost = Lost(what, time.monotonic(), remote=entry.index is None)
        self.answers.lookups_lost(entry.identity, what)
        self.adapter_ops.lost(entry.identity)
        lost = [self.tables.requests[t] for t in entry.running if t in self.tables.requests]
        for p in sorted(lost, key=lambda p: (p.accepted, p.index)):
            self._after_loss(p, what, crashed)
        self.dispatcher.dispatch(entry.model)

    def _model_crashed(self, entry: WorkerEntry, sig: Signals) -> None:
        """A worker of the model died of ``sig`` running its requests: the model's crash streak grows
        (``routing.crash_streak``); at MODEL_CRASHES the model is failed, before the requests are settled, so
        that they too end ``model_failed`` (the model's verdict wins over a request's poison)."""
        mq = self.tables.models[entry.model]
        self.tables.stats["worker_crashed"] += 1
        tickets = [t for t in entry.running if t in self.tables.requests and not self.tables.requests[t].answered]
        mq.crash_streak = crash_streak(mq, tickets)
        mq.crashed.update(tickets)
        if mq.crash_streak >= MODEL_CRASHES and mq.failed is None:
            log.error("model %s: its workers crashed with %s on %d different requests in a row; failing the model",
                      mq.name, sig.name, mq.crash_streak)
            self.fail_model(mq, crash_verdict(sig))

    def _after_loss(self, p: Pending, what: str, crashed: bool) -> None:
        """Settle one request of a worker that died or stalled: requeue it first in line (from its streamed
        tokens, if any), or fail it; a request of a failed model ends ``model_failed``."""
        self.answers.left_slot(p)
        if p.answered:
            self.answers.finish(p)
            return
        if crashed:
            p.crashes += 1
        else:
            p.handovers += 1
        mq = self.tables.models[p.model]
        outcome = after_loss(p)
        if mq.failed is not None:
            self.answers.answer_error(p, ErrorCode.MODEL_FAILED, mq.refusal())
        elif outcome is AfterLoss.POISON:
            self.tables.stats[ErrorCode.POISON_REQUEST] += 1
            self.answers.answer_error(p, ErrorCode.POISON_REQUEST, f"this request was running on {p.crashes} "
                                      "workers that crashed or stalled; it will not be retried")
        elif outcome is AfterLoss.BOUND:
            self.tables.stats[ErrorCode.WORKER_LOST] += 1
            self.answers.answer_error(p, ErrorCode.WORKER_LOST, f"{what}; this request has lost {p.handovers} "
                                      f"workers that were killed or went away, the bound on hand-overs "
                                      f"({MAX_HANDOVERS}), and is not handed over again; retry the request")
        elif outcome is AfterLoss.LOST:
            self.tables.stats[ErrorCode.WORKER_LOST] += 1
            self.answers.answer_error(p, ErrorCode.WORKER_LOST, f"{what} after it had streamed text; retry the request")
        else:
            resumed = bool(p.generated)
            self.tables.stats["resumed" if resumed else "retried"] += 1
            log.info("%s request %s: %s", f"resuming after {len(p.generated) // 4} tokens" if resumed
                     else "retrying", p.request.id, what)
            p.state = RequestState.QUEUED
            spans.requeued(p, "hand-over")
            mq.queue.requeue(p.ticket, p.tenant, p.priority, p.cost)

    def model_failed(self, model: str, message: str) -> None:
        """The supervisor gave up loading ``model`` (``message``: the load error)."""
        self.fail_model(self.tables.models[model], f"cannot be loaded: {message}")

    def fail_model(self, mq: ModelQueue, reason: str) -> None:
        """The model serves nothing more: its queued requests, and those of its workers that die from now on,
        end ``model_failed``, and new ones are refused; ``reason`` follows "model NAME " in the message."""
        mq.failed = reason
        for ticket in mq.queue:
            mq.queue.remove(ticket)
            self.answers.answer_error(self.tables.requests[ticket], ErrorCode.MODEL_FAILED, mq.refusal())


def crash_verdict(sig: Signals) -> str:
    """Why a model whose workers crash on every request failed, and what to try (after "model NAME ")."""
    return (f"crashed its workers with {sig.name} on {MODEL_CRASHES} different requests in a row, none done "
            "between: its engine fails on this host, whatever the request. Try the model with repack: false "
            "(--no-repack; llama.cpp's repacked CPU kernels crash on some AMX and AVX-512 hosts), or with other "
            "n_gpu_layers or flash_attn settings, then restart the server")
