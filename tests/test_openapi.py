"""``/openapi.json`` describes the gateway, and schemathesis fuzzes a real ``mpserve start --http`` from it:
no 5xx other than the documented 502/503/504, every status and content type one the document declares.
A small context (``--n-ctx 64``) keeps each generation short.

    the suite            derandomized: the same cases every run, MPSERVE_OPENAPI_EXAMPLES per operation
                         (schemathesis's own coverage and example cases come first)
                           ->  the run's summary names the mode, the cases sent and a digest of them,
                               so two runs that print the same line sent the same cases
    python -m bench.fuzz MPSERVE_OPENAPI_SEED (a new one each round) and many examples; MPSERVE_OPENAPI_LOG
                         gets a JSON line per case sent, the whole request and its failure where it failed;
                         past MPSERVE_OPENAPI_UNTIL every operation skips the rest of its cases
    regressions          tests/data/openapi_regressions.json: each case a fuzz run found, sent again every run
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ServerProcess
from helpers import free_port, http_up, wait_for
from hypothesis import HealthCheck, Phase, settings

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import content_type_conformance, status_code_conformance  # noqa: E402
from schemathesis.core import NotSet  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402

EXAMPLES_PER_OPERATION = int(os.environ.get("MPSERVE_OPENAPI_EXAMPLES", "20"))
SEED = os.environ.get("MPSERVE_OPENAPI_SEED")  # unset: derandomized
LOG = os.environ.get("MPSERVE_OPENAPI_LOG")
UNTIL = float(os.environ.get("MPSERVE_OPENAPI_UNTIL", "inf"))  # a time.time() after which no case is sent
ALLOWED_5XX = {502, 503, 504}
REGRESSIONS = Path(__file__).parent / "data" / "openapi_regressions.json"
CURL_BASE_URL = "http://127.0.0.1:8000"  # the curl lines printed for a finding: where to send them again


def as_request(case: Any) -> dict[str, Any]:
    """A case as an entry of the regressions file takes it: only the parts the case sets."""
    request: dict[str, Any] = {"method": case.method.upper(), "path": case.path}
    for key in ("path_parameters", "query", "headers", "cookies"):
        if getattr(case, key):
            request[key] = dict(getattr(case, key))
    if not isinstance(case.body, NotSet):
        request["body"] = case.body
        if case.media_type != "application/json":
            request["media_type"] = case.media_type
    return request


class Draws:
    """The cases sent, counted per operation and digested in order; with MPSERVE_OPENAPI_LOG, a line for each.
    Registered as a plugin for the run, it prints its summary at the end."""

    def __init__(self) -> None:
        self.per_operation: Counter[str] = Counter()
        self.digest = hashlib.sha256()

    def sent(self, case: Any, status: int | None, failure: BaseException | None) -> None:
        request = as_request(case)
        self.per_operation[case.operation.label] += 1
        self.digest.update(json.dumps(request, sort_keys=True, default=repr).encode())
        if LOG is None:
            return
        line: dict[str, Any] = {"status": status}
        if failure is not None:
            line |= {"request": request, "failure": title(failure), "detail": str(failure).split("\n")[0][:300],
                     "curl": case.as_curl_command(base_url=CURL_BASE_URL)}
        with open(LOG, "a") as log:
            log.write(json.dumps(line, default=repr) + "\n")

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        counts = self.per_operation.values()
        mode = f"seed {SEED}" if SEED is not None else "derandomized"
        terminalreporter.write_line(
            f"openapi fuzz: {mode}, {EXAMPLES_PER_OPERATION} examples per operation: {sum(counts)} cases sent to "
            f"{len(counts)} operations (fewest {min(counts, default=0)}), digest {self.digest.hexdigest()[:16]}")


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
def api(gateway_url: str) -> Any:
    schema = schemathesis.openapi.from_url(f"{gateway_url}/openapi.json")
    schema.config.output.sanitization.update(enabled=False)  # max_tokens is no secret: reports show the value
    if SEED is not None:
        schema.config.seed = int(SEED)  # each operation draws from a seed made of it and its name
    return schema


@pytest.fixture(scope="module")
def draws(request: pytest.FixtureRequest) -> Draws:
    drawn = Draws()
    request.config.pluginmanager.register(drawn, "mpserve-openapi-draws")
    return drawn


schema = schemathesis.pytest.from_fixture("api")


@pytest.mark.timeout(120)
def test_the_document_names_every_route_and_its_limits(gateway_url) -> None:
    doc = httpx.get(f"{gateway_url}/openapi.json", timeout=10).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/responses/{id}", "/v1/messages",
            "/v1/rerank", "/rerank", "/v1/embeddings", "/v1/models", "/health", "/metrics"} <= set(doc["paths"])
    assert {"n", "echo", "best_of", "logprobs"} <= set(doc["components"]["schemas"]["CompletionRequest"]["properties"])
    post = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "408", "413", "429", "502", "503", "504"} <= set(post) and "500" not in post


def check(case: Any, response: Any) -> None:
    """Fails on an undocumented 5xx, or a status or content type the document does not declare."""
    assert response.status_code < 500 or response.status_code in ALLOWED_5XX, (response.status_code,
                                                                                response.text[:300])
    case.validate_response(response, checks=[status_code_conformance, content_type_conformance])


def title(failure: BaseException) -> str:
    """What failed, without what differs from case to case (two cases with one title are one finding)."""
    if isinstance(failure, FailureGroup):  # schemathesis's checks
        return "; ".join(sorted({getattr(f, "title", type(f).__name__) for f in failure.exceptions}))
    return type(failure).__name__


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=SEED is None, database=None,
          phases=[Phase.explicit, Phase.generate] + ([Phase.shrink] if SEED is not None else []),  # shrink: deep runs
          suppress_health_check=list(HealthCheck))
@pytest.mark.timeout(180 * max(1, EXAMPLES_PER_OPERATION // 40))
def test_fuzzed_from_the_document_no_undocumented_5xx(case, draws: Draws) -> None:
    if time.time() > UNTIL:  # each operation's first case after it skips the operation (an interrupt would not)
        pytest.skip("MPSERVE_OPENAPI_UNTIL has passed")
    status = None
    try:
        response = case.call(timeout=30)
        status = int(response.status_code)
        check(case, response)
    except KeyboardInterrupt:
        raise
    except BaseException as failure:  # a timeout's too
        draws.sent(case, status, failure)
        raise
    draws.sent(case, status, None)


def _regressions() -> list[dict[str, Any]]:
    return list(json.loads(REGRESSIONS.read_text()))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("found", _regressions(), ids=lambda found: found["id"])
def test_each_case_a_fuzz_run_found_is_answered_as_documented(api, found: dict[str, Any]) -> None:
    request = found["request"]
    operation = api[request["path"]][request["method"]]
    case = operation.Case(**{key: value for key, value in request.items() if key not in ("method", "path")})
    check(case, case.call(timeout=30))
