"""OpenTelemetry traces of one request across the gateway, the broker and the worker (``mpserve.tracing``): each
process exports its spans over OTLP/HTTP to an endpoint of the test's own (a real HTTP server decoding OpenTelemetry's
protobuf), and the spans hang under the caller's trace, each process's under the one before it."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from helpers import free_port, wait_for
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

pytestmark = pytest.mark.timeout(120)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = "00f067aa0ba902b7"


@dataclass(frozen=True)
class Span:
    name: str
    trace: str
    span: str
    parent: str
    process: str
    attributes: dict[str, object]


class Collector(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP endpoint: every span exported to ``/v1/traces``, decoded."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        super().__init__(("127.0.0.1", free_port()), _Receive)


class _Receive(http.server.BaseHTTPRequestHandler):
    server: Collector

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        export = ExportTraceServiceRequest.FromString(body)
        for resource in export.resource_spans:
            process = next((a.value.string_value for a in resource.resource.attributes
                            if a.key == "mpserve.process"), "")
            for scope in resource.scope_spans:
                self.server.spans.extend(
                    Span(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), process,
                         {a.key: _value(a.value) for a in s.attributes}) for s in scope.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _value(value: object) -> object:
    kind = value.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(value, kind) if kind else None


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    server = Collector()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


def test_one_request_leaves_spans_from_the_gateway_the_broker_and_the_worker_under_the_callers_trace(
        start_server: type, collector: Collector) -> None:
    port = free_port()
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.server_port}",
           "OTEL_BSP_SCHEDULE_DELAY": "50"}
    start_server("--model", "builtin:tiny", "--http", f"127.0.0.1:{port}", env=env).wait_ready()
    answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, headers={
        "traceparent": f"00-{TRACE}-{CALLER}-01", "X-Request-Id": "traced-1"},
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0})
    assert answer.status_code == 200, answer.text

    def under_trace() -> dict[str, Span] | None:
        spans = {s.name: s for s in collector.spans if s.trace == TRACE}
        return spans if {"POST /v1/chat/completions", "queue", "prefill", "decode"} <= set(spans) else None

    spans = wait_for(under_trace, 30, "the four spans of the request under the caller's trace")
    http_span, queue = spans["POST /v1/chat/completions"], spans["queue"]
    assert (http_span.process, http_span.parent) == ("gateway", CALLER)
    assert (queue.process, queue.parent) == ("broker", http_span.span)
    for name in ("prefill", "decode"):
        assert (spans[name].process, spans[name].parent) == ("worker", queue.span), spans[name]
    assert http_span.attributes["http.response.status_code"] == 200
    assert http_span.attributes["mpserve.request_id"] == "traced-1"
    assert spans["decode"].attributes["mpserve.completion_tokens"] == 4
    assert queue.attributes["mpserve.worker"] == spans["prefill"].attributes["mpserve.worker"]


def test_a_request_without_a_trace_context_starts_a_trace_of_its_own(start_server: type,
                                                                    collector: Collector) -> None:
    """A ZeroMQ client that sends no traceparent: the broker's span is the root, the worker's its children."""
    from mpserve.client import Client

    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.server_port}",
           "OTEL_BSP_SCHEDULE_DELAY": "50"}
    server = start_server("--model", "builtin:tiny", env=env).wait_ready()
    with Client(server.address) as client:
        client.generate("hello", max_tokens=2, temperature=0, request_id="untraced-1")

    def root() -> Span | None:
        return next((s for s in collector.spans if s.name == "queue"
                     and s.attributes.get("mpserve.request_id") == "untraced-1"), None)

    queue = wait_for(root, 30, "the broker's span of the request")
    assert queue.parent == ""
    wait_for(lambda: {s.name for s in collector.spans if s.parent == queue.span} >= {"prefill", "decode"}, 30,
             "the worker's spans under the broker's")


def test_a_request_handed_over_after_its_worker_died_has_a_hand_over_span_under_the_same_trace(
        start_server: type, collector: Collector) -> None:
    """The worker admitting the request crashes (the tests' crash injection), so it is sent to the other instance:
    its second wait is a "hand-over" span (attempt 2), a sibling of its first "queue" under the gateway's span."""
    from mpserve.worker.loop import CRASH_ON

    trace = "5bf92f3577b34da6a3ce929d0e0e4737"
    port = free_port()
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.server_port}",
           "OTEL_BSP_SCHEDULE_DELAY": "50", CRASH_ON: "CRASH-HERE"}
    start_server("--model", "builtin:tiny", "--instances", "2", "--http", f"127.0.0.1:{port}", env=env).wait_ready()
    answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                        headers={"traceparent": f"00-{trace}-{CALLER}-01"},
                        json={"prompt": "CRASH-HERE, then more", "max_tokens": 4, "temperature": 0})
    assert answer.status_code >= 500 and "crashed" in answer.text, answer.text

    def both() -> list[Span] | None:
        waits = sorted((s for s in collector.spans if s.trace == trace and s.process == "broker"),
                       key=lambda s: int(str(s.attributes["mpserve.attempt"])))
        return waits if len(waits) == 2 else None

    first, second = wait_for(both, 30, "the request's two waits for a slot")
    assert (first.name, first.attributes["mpserve.attempt"]) == ("queue", 1)
    assert (second.name, second.attributes["mpserve.attempt"]) == ("hand-over", 2)
    assert first.parent == second.parent != ""
    assert first.attributes["mpserve.worker"] != second.attributes["mpserve.worker"]
