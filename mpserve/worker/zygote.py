"""A model's zygote: a process that loads the model's weights once and forks the model's instances, which then
share those pages copy-on-write instead of each holding its own copy.

    supervisor --fork server--> zygote_main: CUDA hidden, own session, the llama.cpp model loaded and its LoRA
                                adapters onto it (no context, no decode: llama.cpp's thread pool and OpenMP are
                                not started before a fork)
    supervisor --WorkerSpec over the pipe--> zygote --os.fork--> child: worker_main(spec, model), the loop a
                                                                 started worker runs; it makes its own context
                                                                 and warms it up (its first decode)
    zygote --("forked", index, pid)--> supervisor       after each fork (pid 0: the fork failed)
    zygote --("exited", pid, exit code)--> supervisor   once it has reaped that child (pidfd readable)

A child needs nothing of the zygote once forked: it runs in its own session, watches the server (its spec's
``parent_pid``), not the zygote, and outlives a zygote that dies. Nothing in a child writes to the weights:
llama.cpp reads them, and a child that unloads frees only its own mapping (a later load reads the file). The
zygote exits when the supervisor closes its end of the pipe or dies, and leaves its children running. If the
model cannot be loaded here, the zygote forks children without it: each loads the file and reports the
failure as a started worker does.
"""

from __future__ import annotations

import logging
import os
import select
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from .main import worker_main
from .spec import EngineSpec, WorkerSpec

log = logging.getLogger("mpserve.zygote")


def zygote_main(engine: EngineSpec, model: str, conn: Connection, log_level: str) -> None:
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU model: no CUDA context here, before or after a fork
    os.setsid()  # as a worker: Ctrl-C reaches the server, which stops the zygote when it is done
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s zygote ({model}): %(message)s")
    weights = _load(engine)
    adapters = _load_adapters(engine, weights)
    children: dict[int, int] = {}  # pidfd -> pid, until reaped
    try:
        while True:
            ready, _, _ = select.select([conn.fileno(), *children], [], [])
            for fd in [fd for fd in ready if fd in children]:
                pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                conn.send(("exited", pid, os.waitstatus_to_exitcode(status)))
            if conn.fileno() in ready:
                spec: WorkerSpec = conn.recv()
                pid = _fork(spec, weights, adapters, conn, children)
                if pid:
                    children[os.pidfd_open(pid)] = pid
                conn.send(("forked", spec.index, pid))
    except (EOFError, OSError):  # the supervisor closed the pipe, or is gone
        log.debug("the supervisor is gone; exiting, %d instance(s) keep running", len(children))


def _load(engine: EngineSpec) -> Any:
    """The model's weights, loaded as a worker would load them (None if they cannot be)."""
    import llama_cpp

    from mpserve.engine.model_info import load_model

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # as the engines quiet it
    llama_cpp.llama_backend_init()
    t0 = time.perf_counter()
    try:
        weights = load_model(llama_cpp, engine.path, engine.n_gpu_layers, engine.repack)
    except ValueError as exc:
        log.warning("cannot load %s (%s); each instance tries it itself", engine.path, exc)
        return None
    log.info("loaded %s in %.2f s (repack=%s); instances are forked from here", engine.path,
             time.perf_counter() - t0, engine.repack)
    return weights


def _load_adapters(engine: EngineSpec, weights: Any) -> dict[str, Any]:
    """The model's LoRA adapters loaded onto ``weights``, so that every instance shares their tensors; none if one
    cannot be (each instance then loads them itself, and one that cannot reports why)."""
    if weights is None or not engine.adapters:
        return {}
    import llama_cpp

    from mpserve.engine.adapters import preload
    from mpserve.errors import MpserveError

    try:
        return preload(llama_cpp, weights, engine.path, engine.adapters)
    except MpserveError as exc:
        log.warning("cannot load the adapters here (%s); each instance tries them itself", exc.message)
        return {}


def _fork(spec: WorkerSpec, weights: Any, adapters: dict[str, Any], conn: Connection,
          children: dict[int, int]) -> int:
    """Fork the instance ``spec`` describes; the child runs the worker and never returns. The child's pid (0 if
    the fork failed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError as exc:
        log.error("cannot fork worker %d: %s", spec.index, exc)
        return 0
    if pid:
        return pid
    code = 1
    try:
        conn.close()
        for fd in children:
            os.close(fd)
        worker_main(spec, weights, adapters)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
