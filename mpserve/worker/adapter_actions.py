"""ADAPTER_ACTION: a LoRA adapter loaded or unloaded at runtime, answered between steps; and the adapters a worker
keeps across model loads.

    broker --ADAPTER_ACTION--> answer(engine, declared, base, action) --ADAPTER_REPLY or ERROR--> broker

``declared`` (name -> path) starts as the spec's adapters and follows every load and unload, so a model loaded
again (after an idle unload, or on demand) comes back with the adapters the instance had. Without a model in
memory an adapter is checked against the model file's header and loaded with the model.
"""

from __future__ import annotations

import time

from mpserve.engine.interface import Engine
from mpserve.errors import BadRequest, MpserveError, UnknownModel
from mpserve.models.lora_file import check_adapter
from mpserve.wire import protocol as wire


def answer(engine: Engine | None, declared: dict[str, str], base: str, worker: str,
           msg: wire.AdapterAction) -> wire.AdapterReply | wire.Error:
    started = time.perf_counter()
    try:
        if msg.op == "load":
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
