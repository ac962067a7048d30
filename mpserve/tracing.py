"""OpenTelemetry traces of a request across its processes: the gateway, the broker and the worker each record their
spans under the caller's trace, and hand the trace on inside the request (``Request.traceparent``, W3C's format).

    HTTP traceparent ──▶ gateway: span "POST /v1/chat/completions" (server), a child of the caller's span
                           │ Request.traceparent: that span (``outgoing``, read where the client builds the request)
                           ▼
    ZeroMQ REQUEST ────▶ broker: "queue" (accepted → assigned to a slot: the routing's choice in its attributes),
                           │     "hand-over" (a lost instance's request sent on), "preempt", "reattach"
                           │ Assign.request.traceparent: the queue span
                           ▼
                         worker: "prefill" (the prompt, its reused tokens in the attributes), "decode"

Off unless ``OTEL_TRACES_EXPORTER`` names an exporter, ``otlp`` or ``console`` (OpenTelemetry's own default is
``otlp``: a server does not send spans where nobody asked it to). Off, nothing of OpenTelemetry is imported and each
hook is one test of ``tracer()`` against None. On, the SDK reads the other standard variables itself
(``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``); a batch processor's thread exports, off the serving path. OTLP goes over
HTTP (protobuf); ``grpc`` is refused at start with what to set instead.

Each process calls ``configure`` once it runs (after a fork: the processor's thread does not survive one). Spans are
recorded once their times are known (``record``: explicit start and end), so no span object waits across a loop's
turns, except the gateway's, which lasts as long as its HTTP exchange.
"""

from __future__ import annotations

import atexit
import contextvars
import os
import re
import sys
import time
from collections.abc import Mapping
from typing import Any

from mpserve.errors import ConfigError

TRACEPARENT_CHARS = 55
_TRACEPARENT = re.compile(r"^(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$")
EXPORTERS = ("otlp", "console")
INSTALL = "pip install 'mpserve[otel]'"

_tracer: Tracer | None = None
_current: contextvars.ContextVar[str] = contextvars.ContextVar("mpserve_traceparent", default="")


def valid(traceparent: str) -> str:
    """``traceparent`` when it is W3C trace context (version 00's four fields), else "": a bad one starts a new
    trace, as the W3C recommendation says, rather than refusing the request."""
    return traceparent if len(traceparent) == TRACEPARENT_CHARS and _TRACEPARENT.match(traceparent) else ""


def exporters(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The exporters ``OTEL_TRACES_EXPORTER`` names (none: tracing is off); ConfigError for one mpserve lacks."""
    named = tuple(e.strip() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip())
    if named in ((), ("none",)):
        return ()
    unknown = [e for e in named if e not in EXPORTERS]
    if unknown:
        raise ConfigError(f"OTEL_TRACES_EXPORTER={','.join(named)}: mpserve exports traces to "
                          f"{' or '.join(EXPORTERS)} (or none); {unknown[0]!r} is not one of them")
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
    if "otlp" in named and protocol not in ("", "http/protobuf"):
        raise ConfigError(f"OTLP protocol {protocol!r}: mpserve sends traces over http/protobuf; set "
                          "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf and the collector's HTTP endpoint (port 4318)")
    return named


def check(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for traces, refusing at start what would fail in every process later: an
    unknown exporter or protocol, or OpenTelemetry not installed."""
    if not exporters(environ):
        return False
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        raise ConfigError(f"OTEL_TRACES_EXPORTER={environ['OTEL_TRACES_EXPORTER']} asks for traces, and "
                          f"OpenTelemetry is not installed here: {INSTALL}, or unset OTEL_TRACES_EXPORTER") from None
    return True


def configure(process: str, environ: Mapping[str, str] = os.environ) -> Tracer | None:
    """This process's tracer (``process``: gateway, broker or worker, the ``mpserve.process`` resource attribute),
    or None when tracing is off. Made once per process (a second call returns the first's); spans left at exit are
    flushed."""
    global _tracer
    if _tracer is not None:
        return _tracer
    if not check(environ):
        return None
    _tracer = Tracer(process, exporters(environ))
    atexit.register(_tracer.shutdown)
    return _tracer


def tracer() -> Tracer | None:
    """The tracer ``configure`` made; None while tracing is off."""
    return _tracer


def outgoing() -> str:
    """The trace context a request built now continues: the gateway's span of the HTTP exchange it serves, else the
    caller's own current OpenTelemetry span (a traced program using the Python client), else "". The second is looked
    up only where OpenTelemetry was imported already, so an untraced program pays one dictionary lookup."""
    current = _current.get()
    if current or "opentelemetry.trace" not in sys.modules:
        return current
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return valid(carrier.get("traceparent", ""))


def serving(traceparent: str) -> contextvars.Token[str]:
    """Make ``traceparent`` what requests built in this context continue (``outgoing``); ``done`` undoes it."""
    return _current.set(traceparent)


def done(token: contextvars.Token[str]) -> None:
    _current.reset(token)


def now_ns() -> int:
    """A span's time: the wall clock in nanoseconds, comparable across processes and hosts."""
    return time.time_ns()


class Tracer:
    """Spans of one process: recorded whole once their times are known, or opened for an HTTP exchange."""

    def __init__(self, process: str, named: tuple[str, ...]) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        service = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "mpserve"}
        self._provider = TracerProvider(resource=Resource.create({**service, "mpserve.process": process}))
        made: dict[str, type[SpanExporter]] = {"otlp": OTLPSpanExporter, "console": ConsoleSpanExporter}
        for name in named:
            self._provider.add_span_processor(BatchSpanProcessor(made[name]()))
        self._tracer = self._provider.get_tracer("mpserve")
        self._propagator = TraceContextTextMapPropagator()

    def record(self, name: str, parent: str, start_ns: int, end_ns: int | None = None,
               attributes: Mapping[str, Any] | None = None, server: bool = False) -> str:
        """A span ``name`` from ``start_ns`` to ``end_ns`` (None: now), a child of ``parent`` (a traceparent; "": a
        new trace), with ``attributes``; its own traceparent, for the spans under it."""
        span = self.open(name, parent, start_ns, attributes, server)
        span.end(end_time=end_ns)
        return self.context_of(span)

    def open(self, name: str, parent: str, start_ns: int | None = None,
             attributes: Mapping[str, Any] | None = None, server: bool = False) -> Any:
        """A span started now (or at ``start_ns``) that its caller ends (``span.end()``)."""
        from opentelemetry import context
        from opentelemetry.trace import SpanKind

        ctx = self._propagator.extract({"traceparent": parent}) if parent else context.Context()
        return self._tracer.start_span(name, context=ctx, kind=SpanKind.SERVER if server else SpanKind.INTERNAL,
                                       start_time=start_ns, attributes=dict(attributes or {}))

    def context_of(self, span: Any) -> str:
        """``span``'s traceparent."""
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier.get("traceparent", "")

    def shutdown(self) -> None:
        """Export what is left (at exit)."""
        self._provider.shutdown()
