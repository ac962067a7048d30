"""mpserve: several llama.cpp instances behind one ZeroMQ broker, with per-GPU permits.

Three kinds of process, one subpackage each, over shared leaves:

    server/   broker + supervisor (never imports llama_cpp)
    worker/   one engine per process, driven by the broker
    gateway/  the OpenAI-compatible HTTP front (talks to the server through the client)
    engine/   the compute core, used by workers (the only importer of llama_cpp; never imports zmq)
    gpu/      devices, placement, permits          models/  the built-in GGUFs
    leaves:   errors, protocol, config, settings, runtime, slots, prefix, structured, gguf_header,
              speculative, zmqio, client, cli, doctor

The clients are loaded on first use, so importing a leaf (as the engine does) does not load ZeroMQ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import MpserveError

if TYPE_CHECKING:
    from .client import AsyncClient, Client, Result

__all__ = ["AsyncClient", "Client", "MpserveError", "Result"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("AsyncClient", "Client", "Result"):
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module 'mpserve' has no attribute {name!r}")
