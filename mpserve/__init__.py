"""mpserve: several llama.cpp instances behind one ZeroMQ broker, with per-GPU permits.

Three kinds of process, one subpackage each, over shared groups:

    server/   broker + supervisor (never imports llama_cpp)
    worker/   one engine per process, driven by the broker
    gateway/  the OpenAI-compatible HTTP front (talks to the server through the client)
    engine/   the compute core, used by workers (the only importer of llama_cpp; never imports zmq)
    wire/     how they talk: protocol, zmqio, prefix, the slot table
    config/   what a server is told: settings, loader, sizes, kv_types, speculative
    models/   where models come from (built-in, files, the Hub, Ollama), their GGUF headers, chat templates
    gpu/      devices, placement, permits, memory
    leaves:   errors (the code table), structured (grammar checks), private (files in shared places),
              runtime (a running server's sockets and description), repack, llama_build (the build's probe),
              client, cli, doctor

No two packages import each other (pyproject's import contracts): a lower group never imports a higher one.

The clients are loaded on first use, so importing a leaf (as the engine does) does not load ZeroMQ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mpserve.errors import MpserveError

if TYPE_CHECKING:
    from mpserve.client import AsyncClient, Client, Result

__all__ = ["AsyncClient", "Client", "MpserveError", "Result"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("AsyncClient", "Client", "Result"):
        from mpserve import client

        return getattr(client, name)
    raise AttributeError(f"module 'mpserve' has no attribute {name!r}")
