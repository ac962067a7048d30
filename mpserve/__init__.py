"""mpserve: several llama.cpp instances behind one ZeroMQ broker, with per-GPU permits.

Three kinds of process, one subpackage each, over shared groups and leaf modules:

    server/      broker + supervisor (never imports llama_cpp)
    worker/      one engine per process, driven by the broker
    gateway/     the OpenAI-compatible HTTP front (talks to the server through the client)
    engine/      the compute core, used by workers (the only importer of llama_cpp; never imports zmq)
    wire/        how they talk: protocol, messages, zmqio, prefix, salt (the cache key), adapters, the slot table
    config/      what a server is told: settings, loader, sizes, kv_types, speculative
    models/      where models come from (built-in, files, the Hub, Ollama), their GGUF headers, chat templates
    families/    template families: how each model family's replies carry tool calls and thinking, and the grammar
                 of a forced call in the family's own format
    gpu/         devices, placement, permits, memory
    errors       the error codes, one table, and the exceptions that carry them
    structured   grammar checks, JSON Schema → GBNF (the gateway and the broker check, the engine compiles)
    digit_ranges GBNF for the decimal integers in a range (the schema compiler's bounded numbers)
    private      this user's folders and files in shared places: 0700/0600, checked, never through a link
    children     how a Python child is started: never with its working directory on its sys.path
    runtime      where a running server keeps its sockets and description, and how other processes find it
    repack       whether llama.cpp may repack weights on this host (a probe in a child, its verdict cached)
    llama_build  the installed llama.cpp build, probed in a child, and what keeps it from the GPUs found
    client       ``Client`` / ``AsyncClient``: the ZeroMQ clients
    client_track what a client keeps of each completion it sent, for a reattach
    waits        ``within``: a wait with a time limit that keeps its task's cancellation (``asyncio.wait_for``
                 before Python 3.12 loses one that meets the end of what it waits for)
    cli          the ``mpserve`` command line: its options declared once (settings, the operator commands' bundle)
    start        what ``mpserve start`` runs: the server, the gateway fleet of --http beside it, the upgrade's exec
    operator_link  how an operator command reaches a running server: which one, its CURVE keys, a client
    status_text  what the commands print (``status``, ``models``, ``generate``, ``slots``, ``devices``), and the
                 error naming the servers running here
    help_labels  ``--help``'s type labels: none for a flag, which takes no value
    counts       counts in messages: "1 request", "2 requests"
    doctor       ``mpserve doctor``: what this host offers, and what to fix
    tracing      OpenTelemetry traces of a request across the gateway, the broker and the worker (W3C traceparent)

Where a request's way is decided (docs/development.md, "Package layout", says more):

    tenants      a request's tenant: its API key's digest (gateway/http/keys) or its CURVE client key, taken by
                 the broker (server/clients: the gateway's caller on the admin socket, the connection's
                 elsewhere); its share and limits in config/tenants, applied by server/tenants; it changes the
                 cache key in one place, wire/salt: gateway (fallback salt) ─▶ broker (salt of tenant,
                 cache_salt, adapters: server/tables) ─▶ engine (the key, with the adapters' loads)
    adapters     a LoRA adapter chosen by the request (model BASE:NAME, llama-server's lora ids: wire/adapters),
                 routed to an instance that has it loaded (server/dispatch, server/routing: affinity), applied
                 per context in turns (engine/adapters); loaded at run time by ``mpserve adapters``
                 (server/adapter_ops, worker/adapter_actions)
    server dies  its instances (requests parked, models loaded) and zygotes (weights) wait adopt_wait seconds
                 for the next start, which adopts them; clients and gateways reattach; the host store stays
                 (worker/loop: orphaned, server/adoption; docs/operations.md, "When the server dies")

Words. The host store: the KV cells of computed prompts saved for the whole host, in RAM and on disk (``cache_ram``,
``cache_disk``; "prompt cache" in llama-server's words). A slot, three ways: a row of the slot table (one sequence
place of an instance, SLOT in ``mpserve status``: ``wire.slots``), the KV file an idle slot's cells are saved to
(``mpserve slots save``: ``worker.slot_files``), and llama-server's HTTP route ``/slots/SLOT`` that saves and
restores them (``gateway.slots``), whose SLOT is that row.

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
