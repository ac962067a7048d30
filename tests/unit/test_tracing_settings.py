"""Which traces the environment asks for (``mpserve.tracing``): W3C trace contexts taken or set aside, exporters and
protocols mpserve has, refused at start with what to set."""

from __future__ import annotations

import pytest

from mpserve import tracing
from mpserve.errors import ConfigError

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("given", [
    "", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",  # too short
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # the version W3C forbids
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # an all-zero trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # an all-zero span id
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper case
    GOOD + "\n", GOOD.replace("-", "_"),
])
def test_a_trace_context_that_is_not_w3c_s_is_set_aside(given: str) -> None:
    assert tracing.valid(given) == ""


def test_a_w3c_trace_context_is_taken() -> None:
    assert tracing.valid(GOOD) == GOOD


@pytest.mark.parametrize("value", ["", "none", " none "])
def test_tracing_is_off_unless_an_exporter_is_named(value: str) -> None:
    assert tracing.exporters({"OTEL_TRACES_EXPORTER": value}) == ()
    assert tracing.exporters({}) == ()
    assert not tracing.check({"OTEL_TRACES_EXPORTER": value})


def test_exporters_are_read_as_opentelemetry_lists_them() -> None:
    assert tracing.exporters({"OTEL_TRACES_EXPORTER": "otlp, console"}) == ("otlp", "console")


def test_an_unknown_exporter_is_refused_naming_the_ones_there_are() -> None:
    with pytest.raises(ConfigError, match=r"'zipkin' is not one of them.*"):
        tracing.exporters({"OTEL_TRACES_EXPORTER": "otlp,zipkin"})


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"])
def test_otlp_over_grpc_is_refused_with_what_to_set(variable: str) -> None:
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf"):
        tracing.exporters({"OTEL_TRACES_EXPORTER": "otlp", variable: "grpc"})
    assert tracing.exporters({"OTEL_TRACES_EXPORTER": "otlp", variable: "http/protobuf"}) == ("otlp",)


def test_no_trace_context_goes_out_of_an_untraced_program() -> None:
    assert tracing.outgoing() == ""
    token = tracing.serving(GOOD)
    try:
        assert tracing.outgoing() == GOOD
    finally:
        tracing.done(token)
    assert tracing.outgoing() == ""
