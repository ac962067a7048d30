"""ADAPTER_ACTION: a LoRA adapter loaded or unloaded at runtime, answered between steps; and the adapters a worker
keeps across model loads.

    broker --ADAPTER_ACTION--> answer(engine, declared, spec, action) --ADAPTER_REPLY or ERROR--> broker
    a load's path, links and .. resolved, must lie in one of ``folders(spec)``: the model's ``adapter_dir``, else the
    folders of the model file and of its declared adapters (BadRequest otherwise: an admin call names no file the
    operator did not put there)

``declared`` (name -> path) starts as the spec's adapters and follows every load and unload, so a model loaded
again (after an idle unload, or on demand) comes back with the adapters the instance had. Without a model in
memory an adapter is checked against the model file's header and loaded with the model.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from mpserve.engine.interface import Engine
from mpserve.errors import BadRequest, MpserveError, UnknownModel
from mpserve.models.lora_file import check_adapter
from mpserve.wire import protocol as wire

from .spec import WorkerSpec


def answer(engine: Engine | None, declared: dict[str, str], spec: WorkerSpec,
           msg: wire.AdapterAction) -> wire.AdapterReply | wire.Error:
    started, base, worker = time.perf_counter(), spec.engine.path, spec.identity.decode()
    try:
        if msg.op == "load":
            confine(msg.path, folders(spec))
            if engine is not None:
                engine.load_adapter(msg.name, msg.path)
            elif msg.name in declared:
                raise BadRequest(f"adapter {msg.name!r} is loaded already (from {declared[msg.name]}); unload it "
                                   "first to load another file under that name")
            else:
                check_adapter(msg.name, msg.path, base)
            declared[msg.name] = msg.path
        else:
            if engine is not None:
                engine.unload_adapter(msg.name)
            elif msg.name not in declared:
                raise UnknownModel(f"no adapter {msg.name!r} is loaded for this model (adapters served: "
                                   f"{', '.join(sorted(declared)) or 'none'})")
            declared.pop(msg.name, None)
    except MpserveError as exc:
        return wire.Error(msg.id, exc.code, exc.message)
    names = engine.adapter_names() if engine is not None else tuple(sorted(declared))
    return wire.AdapterReply(msg.id, worker, msg.op, msg.name, names, (time.perf_counter() - started) * 1000)


def folders(spec: WorkerSpec) -> tuple[str, ...]:
    """Where an adapter loaded at runtime may come from: the model's ``adapter_dir``, else the folders of the model
    file and of its declared adapters."""
    if spec.adapter_dir is not None:
        return (spec.adapter_dir,)
    files = (spec.engine.path, *spec.engine.adapters.values())
    return tuple(dict.fromkeys(os.path.dirname(os.path.abspath(f)) for f in files if os.path.isfile(f)))


def confine(path: str, allowed: tuple[str, ...]) -> None:
    """BadRequest unless ``path``, its links and ``..`` resolved, lies in one of the folders ``allowed``."""
    real = Path(os.path.realpath(path))
    if not any(real.is_relative_to(os.path.realpath(folder)) for folder in allowed):
        raise BadRequest(f"adapter file {path} is outside the folders adapters may be loaded from "
                         f"({', '.join(allowed) or 'none'}); put it in one, or name its folder with the model's "
                         "adapter_dir (--adapter-dir)")
