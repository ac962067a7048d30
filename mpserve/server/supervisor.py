"""The supervisor: starts worker processes from a clean interpreter, reaps them, and restarts them.

It follows gunicorn's arbiter: a table of workers by index, death noticed through process sentinels
(which the broker's poll loop watches, so no signal handler does work), restarts with a capped
exponential backoff, and a halt instead of a restart loop for a model that cannot load: three failed
loads in a row mark the model failed, and so do MAX_START_FAILURES deaths in a row of an instance, or of its
zygote, before it started (``failing``: the loop tells the broker). ``reap`` returns how a worker ended (its exit
status), which the server's loop hands to the broker: the broker tells a crash from a kill, and fails a model whose
workers crash whatever the request, which the loop passes back (``model_failed``: no more restarts, as after failed
loads).

Workers are started with multiprocessing's "forkserver" method:

    server --first start--> fork server: a fresh interpreter (no ZeroMQ context, CUDA or llama.cpp state
                            from the server) that imports ``spec.preload(gpus)`` once
           --each start---> the fork server forks a worker, which runs ``spec.run``

So a worker starts without importing anything, and every worker shares the fork server's pages of
imported code instead of holding its own copy. The fork server exits when the server does.

A model whose instances keep their weights on the CPU (``mpserve.worker.spec.start_mode``; ``start_method:
fork``, the default) gets a zygote instead (``mpserve.server.zygotes``):

    server --first instance of the model--> zygote, started by the fork server: loads the model's weights
           --each start (scale-up, restart)--> the zygote forks the instance, which shares those weights

A zygote that dies is started again (with the same backoff as a worker that dies on its way up); the
instances it forked keep running. It is stopped once its model has no instance left (scaled to zero,
failed) and started again for the next one.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import zmq

from mpserve import children
from mpserve.config.loader import ServerConfig
from mpserve.wire.slots import SlotState, SlotTable
from mpserve.worker.spec import EXIT_LOAD_FAILED, Adoptable, WorkerSpec, preload, run, start_mode

from . import adoption
from .adoption import AdoptedWorker
from .routing import describe_exit
from .zygotes import ForkedWorker, Zygote, socket_path

log = logging.getLogger("mpserve.supervisor")

MAX_LOAD_FAILURES = 3
MAX_START_FAILURES = 5  # a model's instance, or its zygote, dying this many times in a row before it started fails it
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
KILL_AFTER_S = 2.0  # a stalled worker gets SIGTERM, then SIGKILL this much later
RETIRE_KILL_S = 10.0  # a scaled-down worker told to stop is killed if it is still there this much later
ZYGOTE_EXIT_S = 2.0  # a zygote whose pipe was closed is killed if it has not exited this much later

WorkerProcess = BaseProcess | ForkedWorker | AdoptedWorker


@dataclass
class WorkerHandle:
    spec: WorkerSpec
    process: WorkerProcess | None = None
    registered: bool = False  # the current process reached READY
    crashes: int = 0  # consecutive deaths before READY, for the backoff
    restart_at: float | None = None
    stalled: bool = False  # being stopped by the busy watchdog
    kill_at: float | None = None  # when SIGKILL follows the watchdog's SIGTERM
    retiring: bool = False  # scaled down: told to stop; removed, not restarted, once it exits
    adopting: bool = False  # an instance of the server before this one: killed at ``kill_at`` unless it registers
    superseded: bool = False  # retiring because a roll replaces it (``Supervisor.supersede``)


@dataclass
class ModelHealth:
    load_failures: int = 0  # consecutive, across the model's instances
    failed_message: str | None = None  # set once the model is marked failed
    pending_messages: list[str] = field(default_factory=list)


class Supervisor:
    def __init__(self, config: ServerConfig, specs: list[WorkerSpec], table: SlotTable, gpus: bool,
                 clock: Callable[[], float] = time.monotonic, proof: str = "") -> None:
        """``gpus``: the host has GPUs a worker may use (then the fork server does not import llama_cpp);
        ``clock``: the monotonic time restarts and kills are scheduled on (tests inject one); ``proof``: the
        broker's secret that its own workers show in their READY (``mpserve.server.link``), given to each.

        A process has one fork server, started with the first worker: the ``gpus`` of the first supervisor to
        start one decides its imports; the fork server, which multiprocessing starts with ``-c``, gets the working
        directory off its path (``children.keep_off_path``)."""
        children.keep_off_path()
        self._mp = multiprocessing.get_context("forkserver")
        self._mp.set_forkserver_preload(preload(gpus))
        self._clock = clock
        self._proof = proof
        self._table = table
        self._stall_timeout = config.stall_timeout
        self.workers: dict[int, WorkerHandle] = {spec.index: WorkerHandle(spec) for spec in specs}
        self.health: dict[str, ModelHealth] = {m.name: ModelHealth() for m in config.models}
        self._watched: dict[int, int] = {}  # sentinel fd -> worker index
        self._unwatched: list[int] = []  # started, sentinel not registered yet
        self._start_method = config.start_method
        self._log_level = config.log_level
        self._zygotes: dict[str, Zygote] = {}  # by model
        self._zygote_fds: dict[int, str] = {}  # a zygote's pipe, registered in the poller -> its model
        self._zygote_restart: dict[str, float] = {}  # model -> when its dead zygote starts again
        self._zygote_deaths: Counter[str] = Counter()  # in a row, before an instance it forked registered
        self._retired_zygotes: list[Zygote] = []  # to stop at the next watch, once their pipe is unregistered
        self._told: set[str] = set()  # models whose start mode was logged
        self._kept: set[str] = set()  # models being rolled: their zygote stays (``keep_zygote``)
        self._server_name, self._adopt_wait = config.server_name, config.adopt_wait
        self.failing: list[str] = []  # models failed here that the broker has not been told of (``_start_failed``)

    def start_all(self, adopted: dict[int, int] | None = None, wait: float = 0.0, secrets: tuple[str, ...] = ()
                  ) -> None:
        """Start every worker, but those ``adopted`` (index -> pid: the instances the server before this one left,
        ``mpserve.server.adoption``), which are watched instead, and killed if not registered within ``wait`` s;
        ``secrets``: that server's, whose zygotes this start adopts first."""
        adopted = adopted or {}
        if secrets:
            self._adopt_zygotes(secrets)
        for index in self.workers:
            if index in adopted:
                self._adopt(index, adopted[index], wait)
            else:
                self.spawn(index)
        if not self.workers:  # every model starts at zero: the fork server would start with the first request
            self._warm_fork_server()

    def _warm_fork_server(self) -> None:
        """Start the fork server now and wait until it has imported its modules: the first start through it
        waits for that, and must not hold up the server's loop (clients would hear nothing meanwhile)."""
        process = self._mp.Process(target=int, name="mpserve-fork-server-warm-up")
        process.start()
        process.join()
        process.close()

    def spawn(self, index: int) -> None:
        handle = self.workers[index]
        spec = dataclasses.replace(handle.spec, proof=self._proof)
        for slot, row in enumerate(spec.rows):
            self._table.writer(row).update(pid=0, worker=index, slot=slot, state=SlotState.STARTING,
                                           device=spec.device, model=spec.model, request="", tokens=0,
                                           served=0, started=time.time(), load_s=0.0)
        mode = start_mode(spec, self._start_method)
        if spec.model not in self._told:
            self._told.add(spec.model)
            log.info("%s: instances start from a %s", spec.model, mode)
        process: WorkerProcess
        if mode.zygote:
            process = self._zygote(spec).fork(spec)
        else:
            process = self._mp.Process(target=run, args=(spec,), name=f"mpserve-worker-{index}", daemon=False)
            process.start()
        handle.process, handle.restart_at = process, None
        self._unwatched.append(index)
        log.debug("started worker %d (pid %s) for %s", index, process.pid, spec.model)

    def _adopt(self, index: int, pid: int, wait: float) -> None:
        handle = self.workers[index]
        handle.process, handle.adopting, handle.kill_at = AdoptedWorker(pid), True, self._clock() + wait
        self._unwatched.append(index)
        log.info("worker %d (pid %d, %s) outlived the server before this one; adopting it", index, pid,
                 handle.spec.model)

    def _zygote(self, spec: WorkerSpec) -> Zygote:
        """The model's zygote, started if it has none, or if it holds other weights than ``spec`` asks (a reload
        gave the model another file: the old zygote is stopped, its instances run on)."""
        zygote = self._zygotes.get(spec.model)
        if zygote is not None and zygote.weights != spec.engine.weights():
            log.info("%s's instances now load other weights (%s): stopping the zygote that holds the old ones "
                     "(pid %s); a new one loads them", spec.model, spec.engine.path, zygote.process.pid)
            self._retired_zygotes.append(self._zygotes.pop(spec.model))
            zygote = None
        if zygote is None:
            path = socket_path(self._server_name, spec.model)
            adoptable = Adoptable(str(path), self._proof, self._adopt_wait) if self._adopt_wait else None
            zygote = self._zygotes[spec.model] = Zygote.start(self._mp, spec.model, spec.engine, self._log_level,
                                                              adoptable)
            self._zygote_restart.pop(spec.model, None)
            log.debug("started %s's zygote (pid %s)", spec.model, zygote.process.pid)
        return zygote

    def _adopt_zygotes(self, secrets: tuple[str, ...]) -> None:
        """The zygotes the server before this one left (``secrets``: its), of the models whose instances this start
        forks from a zygote, adopted (``adoption.adopt_zygote``): the instances it must start are forked from the
        weights they hold."""
        for spec in {handle.spec.model: handle.spec for handle in self.workers.values()}.values():
            if start_mode(spec, self._start_method).zygote:
                zygote = self._adopt_zygote(spec, secrets) or self._adopt_zygote(spec, secrets, spare=True)
                if zygote is not None:
                    self._zygotes[spec.model] = zygote

    def _adopt_zygote(self, spec: WorkerSpec, secrets: tuple[str, ...], spare: bool = False) -> Zygote | None:
        """The zygote (or its ``spare``) of ``spec``'s model waiting at its socket, if one is and proves ``secrets``."""
        path = socket_path(self._server_name, spec.model, spare)
        return adoption.adopt_zygote(spec.model, spec.engine, path, secrets, self._proof) if path.exists() else None

    def _zygote_gone(self, model: str) -> None:
        """A zygote died: collect it, and start it again (after a backoff if it keeps dying) while the model
        has instances. The instances it forked keep running."""
        zygote = self._zygotes.pop(model)
        pid, code = zygote.process.pid, zygote.close(ZYGOTE_EXIT_S)
        running = sum(1 for h in self.workers.values() if h.spec.model == model and h.process is not None)
        if not self._needs_zygote(model):
            log.warning("%s's zygote (pid %s) exited with %s", model, pid, describe_exit(code))
            return
        spec = next(h.spec for h in self.workers.values() if h.spec.model == model)
        spare = self._adopt_zygote(spec, (self._proof,), spare=True)
        if spare is not None:
            self._zygotes[model] = spare
            log.warning("%s's zygote (pid %s) exited with %s; its spare (pid %s) took its place, its %d instance(s) "
                        "keep running", model, pid, describe_exit(code), spare.process.pid, running)
            return
        self._zygote_deaths[model] += 1
        if self._zygote_deaths[model] >= MAX_START_FAILURES:
            self._start_failed(model, f"its zygote exited with {describe_exit(code)} {self._zygote_deaths[model]} "
                                      "times in a row before an instance of it started")
            return
        delay = restart_delay(self._zygote_deaths[model])
        self._zygote_restart[model] = self._clock() + delay
        log.warning("%s's zygote (pid %s) exited with %s; its %d instance(s) keep running; restarting it in %.1f s",
                    model, pid, describe_exit(code), running, delay)

    def _needs_zygote(self, model: str) -> bool:
        """The model has an instance running or to restart, not one being retired only, or is being rolled onto
        new settings (``keep_zygote``)."""
        return model in self._kept or any(
            h.spec.model == model and not h.retiring and (h.process is not None or h.restart_at is not None)
            for h in self.workers.values())

    def keep_zygote(self, model: str, keep: bool) -> None:
        """A roll (``mpserve.server.rolling``) replaces the model's instances one by one: its zygote stays while
        the roll runs, even between an old instance's exit and its replacement's start."""
        if keep:
            self._kept.add(model)
        else:
            self._kept.discard(model)
            self._release_zygote(model)

    def supersede(self, model: str, only: set[int] | None = None) -> set[int]:
        """A roll begins: the model's workers (or those of ``only``) are replaced, so none is restarted from its old
        spec; each running one is removed once it exits (as a retired one, but killed only once drained) and one
        waiting to restart is removed now. The indices of the running ones."""
        running: set[int] = set()
        for index, handle in list(self.workers.items()):
            if handle.spec.model != model or handle.retiring or (only is not None and index not in only):
                continue
            if handle.process is None:
                self._forget(index)
                continue
            handle.retiring = handle.superseded = True
            running.add(index)
        return running

    def _forget(self, index: int) -> None:
        """Remove a worker that is not running (and free its rows)."""
        handle = self.workers.pop(index)
        for row in handle.spec.rows:
            self._table.writer(row).update(pid=0, state=SlotState.EMPTY, request="", tokens=0)

    def _release_zygote(self, model: str) -> None:
        """Stop the model's zygote (freeing the weights it holds) if it has no instance left to fork."""
        self._zygote_restart.pop(model, None)
        if model in self._zygotes and not self._needs_zygote(model):
            self._retired_zygotes.append(self._zygotes.pop(model))
            log.info("%s has no instance left: stopping its zygote", model)

    def add(self, spec: WorkerSpec) -> None:
        """Start one more worker (scaling up) at an index no worker holds."""
        assert spec.index not in self.workers
        self.workers[spec.index] = WorkerHandle(spec)
        self.spawn(spec.index)

    def retire(self, index: int) -> None:
        """Worker ``index`` was told to stop for good (scaled down): once it exits it is removed, not restarted;
        if it has not exited within RETIRE_KILL_S it is killed."""
        handle = self.workers[index]
        handle.retiring, handle.restart_at = True, None
        handle.kill_at = self._clock() + RETIRE_KILL_S

    def watch(self, poller: zmq.Poller) -> None:
        """Register the process sentinels of workers started since the last call: a sentinel becomes
        readable when its worker exits, so the caller's poll notices deaths with everything else. (A worker a
        zygote is still forking has no sentinel yet: it waits for a later call.) Also the zygotes' pipes, so
        that their reports are taken as they come, and stop the zygotes released since the last call."""
        for fd in [fd for fd, model in self._zygote_fds.items()
                   if model not in self._zygotes or self._zygotes[model].fileno() != fd]:
            poller.unregister(fd)
            del self._zygote_fds[fd]
        for zygote in self._retired_zygotes:
            zygote.close(ZYGOTE_EXIT_S)
        self._retired_zygotes.clear()
        for model, zygote in self._zygotes.items():
            if zygote.fileno() not in self._zygote_fds:
                poller.register(zygote.fileno(), zmq.POLLIN)
                self._zygote_fds[zygote.fileno()] = model
        waiting = []
        for index in self._unwatched:
            process = self.workers[index].process if index in self.workers else None
            sentinel = process.sentinel if process is not None else None
            if process is not None and sentinel is None:
                waiting.append(index)
            elif sentinel is not None:
                poller.register(sentinel, zmq.POLLIN)
                self._watched[sentinel] = index
        self._unwatched[:] = waiting

    def exited(self, poller: zmq.Poller, events: dict[Any, int]) -> list[int]:
        """The workers whose sentinel fired in ``events``; unregistered, ready to ``reap``. First the reports of
        the zygotes whose pipe fired (a zygote that has gone is collected, and started again)."""
        for fd, model in list(self._zygote_fds.items()):
            zygote = self._zygotes.get(model)
            if fd in events and zygote is not None:
                zygote.pump()
                if not zygote.alive:
                    poller.unregister(fd)
                    del self._zygote_fds[fd]
                    self._zygote_gone(model)
        gone = [fd for fd in self._watched if fd in events]
        for fd in gone:
            poller.unregister(fd)
        return [self._watched.pop(fd) for fd in gone]

    def reap(self, index: int) -> int | None:
        """Collect an exited worker, mark its row dead, and schedule its restart unless its model has
        failed. Returns the exit code."""
        handle = self.workers[index]
        assert handle.process is not None
        handle.process.join(timeout=1.0)
        code = handle.process.exitcode
        pid = handle.process.pid
        handle.process.close()
        handle.process = None
        handle.stalled, handle.kill_at = False, None
        if handle.retiring:
            self._forget(index)  # its rows free for the next instance at this index
            log.info("worker %d (pid %s, %s) stopped: %s", index, pid, handle.spec.model,
                     "replaced by a roll" if handle.superseded else "scaled down")
            self._release_zygote(handle.spec.model)
            return code
        health = self.health[handle.spec.model]
        if code == EXIT_LOAD_FAILED:
            health.load_failures += 1
            if health.load_failures >= MAX_LOAD_FAILURES and health.failed_message is None:
                health.failed_message = (health.pending_messages or ["the worker exited while loading"])[-1]
                log.error("model %s failed to load %d times in a row; not retrying: %s", handle.spec.model,
                          health.load_failures, health.failed_message)
        if health.failed_message is not None:
            self._mark(handle.spec, SlotState.FAILED)
            self._release_zygote(handle.spec.model)
            return code
        self._mark(handle.spec, SlotState.DEAD)
        # A worker that had registered is replaced at once (its death was the request's or the host's
        # doing, and the requests wait); one that died on its way up backs off, to not boot-loop, and fails its
        # model once it died MAX_START_FAILURES times so (its requests would wait for it for ever).
        handle.crashes = 0 if handle.registered else handle.crashes + 1
        handle.registered = False
        if handle.crashes >= MAX_START_FAILURES:
            self._start_failed(handle.spec.model, f"its instance exited with {describe_exit(code)} {handle.crashes} "
                                                  "times in a row before it started")
            return code
        delay = restart_delay(handle.crashes)
        handle.restart_at = self._clock() + delay
        log.warning("worker %d (pid %s, %s) exited with %s; restarting in %.1f s", index, pid,
                    handle.spec.model, describe_exit(code), delay)
        return code

    def load_failed(self, index: int, message: str) -> None:
        """Worker ``index`` reported FAILED; its exit follows and is counted by reap() (an index no worker holds:
        one scaled down meanwhile, nothing to count)."""
        handle = self.workers.get(index)
        if handle is not None:
            self.health[handle.spec.model].pending_messages[:] = [message]

    def model_failed(self, model: str, message: str) -> None:
        """The broker failed ``model`` (its workers crash whatever the request): as after failed loads, none of
        its workers is restarted, and the rows of those that are down say failed. Those still up are left to
        finish what they run (they get nothing new), and stay down once they exit."""
        self.health[model].failed_message = message
        for handle in self.workers.values():
            if handle.spec.model == model and handle.process is None:
                handle.restart_at = None
                self._mark(handle.spec, SlotState.FAILED)
        self._release_zygote(model)

    def _start_failed(self, model: str, message: str) -> None:
        """``model``'s processes keep dying before they start: failed as by the broker, and left in ``failing`` for
        the server's loop to tell the broker (which ends its queued requests ``model_failed``)."""
        log.error("model %s failed: %s; not retrying (the lines above say why)", model, message)
        self.model_failed(model, message)
        self._zygote_deaths.pop(model, None)
        for handle in self.workers.values():
            if handle.spec.model == model:
                handle.crashes = 0  # a load of the model starts counting afresh
        self.failing.append(model)

    def _mark(self, spec: WorkerSpec, state: SlotState) -> None:
        """Write a dead worker's rows (their writer is gone, so the supervisor may)."""
        for row in spec.rows:
            self._table.writer(row).update(state=state)

    def registered(self, index: int, loaded: bool) -> None:
        """Worker ``index`` is up (READY), its crash backoff starts afresh, and if it loaded its model, so
        does the model's count of failed loads."""
        handle = self.workers[index]
        handle.registered, handle.crashes = True, 0
        if handle.adopting:
            handle.adopting, handle.kill_at = False, None
        self._zygote_deaths.pop(handle.spec.model, None)
        if loaded:
            self.health[handle.spec.model].load_failures = 0

    def stop_stalled(self, index: int) -> None:
        """SIGTERM a worker that stopped making progress; SIGKILL follows if it is still there."""
        handle = self.workers[index]
        if handle.process is None or handle.stalled:
            return
        log.warning("worker %d (pid %s) made no progress; stopping it", index, handle.process.pid)
        handle.process.terminate()
        handle.stalled, handle.kill_at = True, self._clock() + KILL_AFTER_S

    def stalled(self) -> dict[int, float]:
        """The busy watchdog's finding: running workers, not already being stopped, with a busy slot that
        generated nothing for ``stall_timeout`` (workers write progress to the slot table on every token), or
        with a row found in the middle of one update that long (``SlotRow.stuck_s``: a worker stopped or hung
        mid-update, whose row says only what it last said whole, busy or not); by index, with those seconds."""
        now = time.time()
        found: dict[int, float] = {}
        for row in self._table.read_all():
            silent = max(now - row.progress if row.state is SlotState.BUSY else 0.0, row.stuck_s)
            handle = self.workers.get(row.worker)
            if (silent > self._stall_timeout and handle is not None and handle.process is not None
                    and not handle.stalled):
                found.setdefault(row.worker, silent)
        return found

    def next_timer(self) -> float | None:
        times = [t for h in self.workers.values() for t in (h.restart_at, h.kill_at) if t is not None]
        times += self._zygote_restart.values()
        return min(times) if times else None

    def tick(self, now: float, restart: bool = True) -> None:
        """Kill stalled workers whose SIGTERM went unheeded; start those (and zygotes) whose backoff is over."""
        for model, at in list(self._zygote_restart.items()):
            if restart and at <= now:
                del self._zygote_restart[model]
                spec = next((h.spec for h in self.workers.values() if h.spec.model == model), None)
                if spec is not None and self._needs_zygote(model):
                    self._zygote(spec)
        for index, handle in self.workers.items():
            if handle.kill_at is not None and handle.kill_at <= now and handle.process is not None:
                if handle.adopting:
                    log.warning("worker %d (pid %s) did not register within its adoption wait; killing it", index,
                                handle.process.pid)
                handle.process.kill()
                handle.kill_at = None
            if restart and handle.restart_at is not None and handle.restart_at <= now:
                self.spawn(index)

    def hand_off(self) -> None:
        """An upgrade: the registered instances are left running for the next start to adopt; those still starting
        are terminated (they never learned of the hand-off), and the zygotes wait to be adopted too."""
        for handle in self.workers.values():
            if handle.process is not None and not handle.registered:
                handle.process.terminate()
        for zygote in self._zygotes.values():
            zygote.hand_off()  # each waits for the next start to adopt it
        for zygote in self._retired_zygotes:
            zygote.close(ZYGOTE_EXIT_S)
        self._zygotes.clear()
        self._retired_zygotes.clear()

    def stop_all(self, timeout: float, leave_grace: float = KILL_AFTER_S) -> None:
        """Wait up to ``timeout`` s for workers that were told to stop; terminate what remains (each finishes its
        step and says LEAVING) and wait up to ``leave_grace`` s; kill what still remains. A worker still starting
        (not registered, so the broker could not tell it to stop) is terminated at once."""
        for handle in self.workers.values():
            handle.restart_at = None
            if handle.process is not None and not handle.registered and handle.process.is_alive():
                handle.process.terminate()
        for step, wait in (("wait", timeout), ("terminate", leave_grace), ("kill", KILL_AFTER_S)):
            alive = [h.process for h in self.workers.values() if h.process is not None and h.process.is_alive()]
            if not alive:
                break
            for process in alive:
                if step == "terminate":
                    process.terminate()
                elif step == "kill":
                    log.warning("worker pid %s did not exit within %g s of its SIGTERM; killing it", process.pid,
                                leave_grace)
                    process.kill()
            deadline = time.monotonic() + wait
            for process in alive:
                process.join(max(0.0, deadline - time.monotonic()))
        for handle in self.workers.values():
            if handle.process is not None:
                handle.process.join(1.0)
                handle.process = None
            self._mark(handle.spec, SlotState.DEAD)
        for zygote in [*self._zygotes.values(), *self._retired_zygotes]:
            zygote.close(ZYGOTE_EXIT_S)
        self._zygotes.clear()
        self._retired_zygotes.clear()


def restart_delay(crashes: int) -> float:
    """Seconds before restarting a worker that died ``crashes`` times in a row before registering: at once
    after a death once it was up, then BACKOFF_FIRST_S doubling up to BACKOFF_MAX_S."""
    return 0.0 if crashes == 0 else min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (crashes - 1))
