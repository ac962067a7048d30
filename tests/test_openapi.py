"""``/openapi.json`` describes the gateway, and schemathesis fuzzes a real ``mpserve start --http`` from it:
no 5xx other than the documented 502/503/504, every status and content type one the document declares.
A small context (``--n-ctx 64``) keeps each generation short; the examples per operation are bounded
(``MPSERVE_OPENAPI_EXAMPLES`` sets how many, for a deeper run than the suite's)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest
from conftest import ServerProcess
from helpers import http_up, wait_for
from hypothesis import HealthCheck, Phase, settings
from test_limits import free_port

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import content_type_conformance, status_code_conformance  # noqa: E402

EXAMPLES_PER_OPERATION = int(os.environ.get("MPSERVE_OPENAPI_EXAMPLES", "40"))
ALLOWED_5XX = {502, 503, 504}


@pytest.fixture(scope="module")
def gateway_url() -> Iterator[str]:
    port = free_port()
    server = ServerProcess("--http", f"127.0.0.1:{port}", "--n-ctx", "64", "--instances", "2").wait_ready()
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_up(url), 30, "the gateway answers /health")
    yield url
    server.stop()
    assert not server.tracebacks(), "\n".join(server.log)


@pytest.fixture(scope="module")
def api(gateway_url: str) -> object:
    return schemathesis.openapi.from_url(f"{gateway_url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api")


@pytest.mark.timeout(120)
def test_the_document_names_every_route_and_its_limits(gateway_url) -> None:
    doc = httpx.get(f"{gateway_url}/openapi.json", timeout=10).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models", "/health",
            "/metrics"} <= set(doc["paths"])
    assert {"n", "echo", "best_of", "logprobs"} <= set(doc["components"]["schemas"]["CompletionRequest"]["properties"])
    post = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "408", "413", "429", "502", "503", "504"} <= set(post) and "500" not in post


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
@pytest.mark.timeout(180 * max(1, EXAMPLES_PER_OPERATION // 40))
def test_fuzzed_from_the_document_no_undocumented_5xx(case) -> None:
    response = case.call(timeout=30)
    assert response.status_code < 500 or response.status_code in ALLOWED_5XX, (response.status_code,
                                                                                response.text[:300])
    case.validate_response(response, checks=[status_code_conformance, content_type_conformance])
