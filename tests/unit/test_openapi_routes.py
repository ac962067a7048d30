"""The OpenAPI document names every JSON route the gateway app has, with each of its methods: a route added
without its entry (as ``/tokenize``, ``/detokenize`` and ``/admin/`` once were) fails here, so the HTTP page
generated from the document, and the fuzz driven by it, cannot miss it. The console's HTML page, its static
files and its icon are the exceptions: they are not an API."""

from __future__ import annotations

import pytest
from starlette.routing import Route
from starlette.testclient import TestClient

from mpserve.gateway.app import GatewayConfig, create_app

pytestmark = pytest.mark.timeout(30)
NOT_AN_API = {"/", "/console", "/static/{name}", "/favicon.ico"}


def test_every_route_and_method_of_the_app_is_in_the_document() -> None:
    app = create_app(GatewayConfig(admin_key="an-admin-key"))
    with TestClient(app, base_url="http://127.0.0.1") as http:
        paths = http.get("/openapi.json").json()["paths"]
    routes = [r for r in app.routes if isinstance(r, Route) and r.path not in NOT_AN_API]
    served = {(r.path, m.lower()) for r in routes for m in r.methods or () if m != "HEAD"}
    documented = {(path, method) for path, operations in paths.items() for method in operations}
    assert served - documented == set()
    assert documented - served == set()

