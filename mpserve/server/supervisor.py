"""The supervisor: starts worker processes from a clean interpreter, reaps them, and restarts them.

It follows gunicorn's arbiter: a table of workers by index, death noticed through process sentinels
(which the broker's poll loop watches, so no signal handler does work), restarts with a capped
exponential backoff, and a halt instead of a restart loop for a model that cannot load: three failed
loads in a row mark the model failed. ``reap`` returns how a worker ended (its exit status), which the
server's loop hands to the broker: the broker tells a crash from a kill, and fails a model whose workers
crash whatever the request, which the loop passes back (``model_failed``: no more restarts, as after
failed loads).

Workers are started with multiprocessing's "forkserver" method:

    server --first start--> fork server: a fresh interpreter (no ZeroMQ context, CUDA or llama.cpp state
                            from the server) that imports ``spec.preload(gpus)`` once
           --each start---> the fork server forks a worker, which runs ``spec.run``

So a worker starts without importing anything, and every worker shares the fork server's pages of
imported code instead of holding its own copy. The fork server exits when the server does.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import zmq

from mpserve.config import ServerConfig
from mpserve.slots import SlotState, SlotTable
from mpserve.worker.spec import EXIT_LOAD_FAILED, WorkerSpec, preload, run

from .routing import describe_exit

log = logging.getLogger("mpserve.supervisor")

MAX_LOAD_FAILURES = 3
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
KILL_AFTER_S = 2.0  # a stalled worker gets SIGTERM, then SIGKILL this much later
RETIRE_KILL_S = 10.0  # a scaled-down worker told to stop is killed if it is still there this much later


@dataclass
class WorkerHandle:
    spec: WorkerSpec
    process: BaseProcess | None = None
    registered: bool = False  # the current process reached READY
    crashes: int = 0  # consecutive deaths before READY, for the backoff
    restart_at: float | None = None
    stalled: bool = False  # being stopped by the busy watchdog
    kill_at: float | None = None  # when SIGKILL follows the watchdog's SIGTERM
    retiring: bool = False  # scaled down: told to stop; removed, not restarted, once it exits


@dataclass
class ModelHealth:
    load_failures: int = 0  # consecutive, across the model's instances
    failed_message: str | None = None  # set once the model is marked failed
    pending_messages: list[str] = field(default_factory=list)


class Supervisor:
    def __init__(self, config: ServerConfig, specs: list[WorkerSpec], table: SlotTable, gpus: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``gpus``: the host has GPUs a worker may use (then the fork server does not import llama_cpp);
        ``clock``: the monotonic time restarts and kills are scheduled on (tests inject one).

        A process has one fork server, started with the first worker: the ``gpus`` of the first supervisor to
        start one decides its imports."""
        self._mp = multiprocessing.get_context("forkserver")
        self._mp.set_forkserver_preload(preload(gpus))
        self._clock = clock
        self._table = table
        self._stall_timeout = config.stall_timeout
        self.workers: dict[int, WorkerHandle] = {spec.index: WorkerHandle(spec) for spec in specs}
        self.health: dict[str, ModelHealth] = {m.name: ModelHealth() for m in config.models}
        self._watched: dict[int, int] = {}  # sentinel fd -> worker index
        self._unwatched: list[int] = []  # started, sentinel not registered yet

    def start_all(self) -> None:
        for index in self.workers:
            self.spawn(index)

    def spawn(self, index: int) -> None:
        handle = self.workers[index]
        spec = handle.spec
        for slot, row in enumerate(spec.rows):
            self._table.writer(row).update(pid=0, worker=index, slot=slot, state=SlotState.STARTING,
                                           device=spec.device, model=spec.model, request="", tokens=0,
                                           served=0, started=time.time(), load_s=0.0)
        process = self._mp.Process(target=run, args=(spec,), name=f"mpserve-worker-{index}",
                                   daemon=False)
        process.start()
        handle.process, handle.restart_at = process, None
        self._unwatched.append(index)
        log.debug("started worker %d (pid %s) for %s", index, process.pid, spec.model)

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
        readable when its worker exits, so the caller's poll notices deaths with everything else."""
        for index in self._unwatched:
            process = self.workers[index].process
            if process is not None:
                poller.register(process.sentinel, zmq.POLLIN)
                self._watched[process.sentinel] = index
        self._unwatched.clear()

    def exited(self, poller: zmq.Poller, events: dict[Any, int]) -> list[int]:
        """The workers whose sentinel fired in ``events``; unregistered, ready to ``reap``."""
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
            del self.workers[index]
            for row in handle.spec.rows:  # free for the next instance at this index
                self._table.writer(row).update(pid=0, state=SlotState.EMPTY, request="", tokens=0)
            log.info("worker %d (pid %s, %s) stopped: scaled down", index, pid, handle.spec.model)
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
            return code
        self._mark(handle.spec, SlotState.DEAD)
        # A worker that had registered is replaced at once (its death was the request's or the host's
        # doing, and the requests wait); one that died on its way up backs off, to not boot-loop.
        handle.crashes = 0 if handle.registered else handle.crashes + 1
        handle.registered = False
        delay = restart_delay(handle.crashes)
        handle.restart_at = self._clock() + delay
        log.warning("worker %d (pid %s, %s) exited with %s; restarting in %.1f s", index, pid,
                    handle.spec.model, describe_exit(code), delay)
        return code

    def load_failed(self, model: str, message: str) -> None:
        """A worker reported FAILED; its exit follows and is counted by reap()."""
        self.health[model].pending_messages[:] = [message]

    def model_failed(self, model: str, message: str) -> None:
        """The broker failed ``model`` (its workers crash whatever the request): as after failed loads, none of
        its workers is restarted, and the rows of those that are down say failed. Those still up are left to
        finish what they run (they get nothing new), and stay down once they exit."""
        self.health[model].failed_message = message
        for handle in self.workers.values():
            if handle.spec.model == model and handle.process is None:
                handle.restart_at = None
                self._mark(handle.spec, SlotState.FAILED)

    def _mark(self, spec: WorkerSpec, state: SlotState) -> None:
        """Write a dead worker's rows (their writer is gone, so the supervisor may)."""
        for row in spec.rows:
            self._table.writer(row).update(state=state)

    def registered(self, index: int, loaded: bool) -> None:
        """Worker ``index`` is up (READY), its crash backoff starts afresh, and if it loaded its model, so
        does the model's count of failed loads."""
        handle = self.workers[index]
        handle.registered, handle.crashes = True, 0
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
        generated nothing for ``stall_timeout`` (workers write progress to the slot table on every token);
        by index, with those seconds of silence."""
        now = time.time()
        found: dict[int, float] = {}
        for row in self._table.read_all():
            silent = now - row.progress
            handle = self.workers.get(row.worker)
            if (row.state is SlotState.BUSY and silent > self._stall_timeout and handle is not None
                    and handle.process is not None and not handle.stalled):
                found.setdefault(row.worker, silent)
        return found

    def next_timer(self) -> float | None:
        times = [t for h in self.workers.values() for t in (h.restart_at, h.kill_at) if t is not None]
        return min(times) if times else None

    def tick(self, now: float, restart: bool = True) -> None:
        """Kill stalled workers whose SIGTERM went unheeded; start those whose backoff is over."""
        for index, handle in self.workers.items():
            if handle.kill_at is not None and handle.kill_at <= now and handle.process is not None:
                handle.process.kill()
                handle.kill_at = None
            if restart and handle.restart_at is not None and handle.restart_at <= now:
                self.spawn(index)

    def stop_all(self, timeout: float) -> None:
        """Wait for workers that were told to stop; terminate, then kill, what remains. A worker still starting
        (not registered, so the broker could not tell it to stop) is terminated at once."""
        for handle in self.workers.values():
            handle.restart_at = None
            if handle.process is not None and not handle.registered and handle.process.is_alive():
                handle.process.terminate()
        deadline = time.monotonic() + timeout
        for sig_step in ("wait", "terminate", "kill"):
            for handle in self.workers.values():
                if handle.process is None:
                    continue
                if sig_step == "terminate" and handle.process.is_alive():
                    handle.process.terminate()
                elif sig_step == "kill" and handle.process.is_alive():
                    handle.process.kill()
                handle.process.join(max(0.0, deadline - time.monotonic()) if sig_step == "wait" else 2.0)
            if not any(h.process is not None and h.process.is_alive() for h in self.workers.values()):
                break
        for handle in self.workers.values():
            if handle.process is not None:
                handle.process.join(1.0)
                handle.process = None
            self._mark(handle.spec, SlotState.DEAD)


def restart_delay(crashes: int) -> float:
    """Seconds before restarting a worker that died ``crashes`` times in a row before registering: at once
    after a death once it was up, then BACKOFF_FIRST_S doubling up to BACKOFF_MAX_S."""
    return 0.0 if crashes == 0 else min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (crashes - 1))
