"""The worker process's entry point: ``worker_main(spec)``, run in a process forked from the fork server of
the supervisor (``mpserve.worker.spec.run``) of a server or of a remote pool, or forked from its model's zygote
(``mpserve.worker.zygote``), which hands it the model's weights loaded already.

    CUDA_VISIBLE_DEVICES set → own session → logging → slot-table rows → DEALER to the broker → permits
    → engine loaded (or left for the broker to ask, single active backend) → Worker.run until told to stop

CUDA_VISIBLE_DEVICES is set before llama_cpp is imported (only ``build_engine`` imports it, except on a host
without GPUs, where the fork server imported it already: ``mpserve.worker.spec.preload``). The worker
exits when told to stop, when its model cannot be loaded (after sending FAILED), or when the server
(or remote pool) that started it is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

from mpserve.engine.echo import EchoEngine
from mpserve.engine.interface import Engine
from mpserve.gpu.permits import DevicePermits, HoldLog
from mpserve.wire.slots import SlotState, SlotTable

from .loop import Worker
from .spec import EngineSpec, WorkerSpec

RECONNECT_MAX_MS = 250
"""The longest wait between two of ZeroMQ's tries to reach the broker while it is down. An instance whose server
died tries the next start's socket (which is there a second or so later) at this pace: a longer backoff would keep
it, and so the start's readiness and every request it holds, waiting up to that long after the socket is there."""

def build_engine(spec: EngineSpec, model: Any = None, adapters: dict[str, Any] | None = None,
                 projector: Any = None) -> Engine:
    """The engine ``spec`` asks for; ``model``: its llama.cpp model, loaded already (None: loaded here), with
    ``adapters`` loaded onto it (``mpserve.engine.adapters.Loaded`` by name; the others of ``spec`` are loaded by
    the engine) and its image ``projector`` (``mpserve.engine.media.Projector``; None: loaded by the engine)."""
    if spec.adapters and (spec.is_echo or spec.embedding):
        raise ValueError("LoRA adapters need a model served for completions by llama.cpp, not the echo backend or "
                         "an embedding model; declare them on such a model")
    if spec.is_echo:
        return EchoEngine(spec.parallel, spec.echo_tick_s)
    if spec.embedding:
        from mpserve.engine.embed import EmbeddingEngine  # imports llama_cpp, now that CUDA_VISIBLE_DEVICES is set

        return EmbeddingEngine(spec.path, spec.n_ctx, spec.parallel, spec.threads, spec.n_gpu_layers, spec.pooling,
                               spec.repack, model=model)
    from mpserve.engine.batch import BatchEngine  # imports llama_cpp, now that CUDA_VISIBLE_DEVICES is set
    from mpserve.engine.settings import EngineSettings

    settings = EngineSettings(spec.path, spec.n_ctx, spec.parallel, spec.threads, spec.n_gpu_layers, spec.seed,
                              flash_attn=spec.flash_attn, repack=spec.repack, speculative=spec.speculative,
                              reasoning=spec.reasoning,
                              cache_type_k=spec.cache_type_k, cache_type_v=spec.cache_type_v, cache_ram=spec.cache_ram,
                              cache_shm=spec.cache_shm, cache_disk=spec.cache_disk,
                              cache_disk_size=spec.cache_disk_size, cache_remote=spec.cache_remote, reuse=spec.reuse,
                              chat_template=spec.chat_template,
                              adapters=tuple(spec.adapters.items()), mmproj=spec.mmproj)
    return BatchEngine(settings, model, adapters, projector)


def _builder(model: Any, adapters: dict[str, Any] | None, projector: Any) -> Callable[[EngineSpec], Engine]:
    """``build_engine`` that hands ``model`` (and the adapters and projector loaded with it) to the first engine it
    builds: an engine built again after an unload loads the files itself (the first one freed them when it closed)."""
    left = [(model, adapters, projector)]

    def build(spec: EngineSpec) -> Engine:
        (taken, loaded, shared), left[0] = left[0], (None, None, None)
        return build_engine(spec, taken, loaded, shared)

    return build


def worker_main(spec: WorkerSpec, model: Any = None, adapters: dict[str, Any] | None = None,
                projector: Any = None) -> None:
    """``model``: the llama.cpp model of ``spec.engine.path``, loaded by the zygote this process was forked from
    (None: the worker loads it), with ``adapters`` loaded onto it and its image ``projector`` beside it."""
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the order NVML and nvidia-smi number devices in
    os.environ["CUDA_VISIBLE_DEVICES"] = str(spec.device) if spec.device >= 0 else ""
    os.setsid()  # out of the server's process group: Ctrl-C or a group-wide SIGTERM reaches the server,
    # which finishes requests and then stops its workers; a worker notices a dead server by itself.
    logging.basicConfig(level=spec.log_level.upper(), stream=sys.stderr, force=True,  # a zygote's goes
                        format=f"%(asctime)s %(levelname)s worker {spec.index} ({spec.model}): %(message)s")
    table = SlotTable.attach(Path(spec.slots_path))
    rows = [table.writer(row) for row in spec.rows]
    for row in rows:
        row.update(pid=os.getpid(), state=SlotState.STARTING, request="", tokens=0, served=0, started=time.time(),
                   kv_cells=0, kv_capacity=spec.engine.n_ctx)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, spec.identity)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)  # ZeroMQ reconnects by itself, backing off up to RECONNECT_MAX_MS
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
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
        worker = Worker(spec, sock, rows, _builder(model, adapters, projector), permits)
        if spec.lazy:
            worker.set_rows(state=SlotState.UNLOADED)
        else:
            worker.load()
        worker.leave_on(signal.SIGTERM)  # after the load: a worker terminated while loading ends at once
        worker.run()
    finally:
        if permits is not None:
            permits.close()
        sock.close()
        ctx.term()
        table.close()
