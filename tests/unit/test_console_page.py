"""The console's page asks for nothing that is not there: its icon is served (a browser asks for /favicon.ico, or
the icon the page links), without the API key, as the page itself is."""

from __future__ import annotations

import re

import pytest
from starlette.testclient import TestClient

from mpserve.gateway.app import GatewayConfig, create_app

pytestmark = pytest.mark.timeout(30)


def test_the_favicon_and_every_file_the_page_links_are_answered_without_the_key() -> None:
    with TestClient(create_app(GatewayConfig(api_key="a-key")), base_url="http://127.0.0.1") as http:
        page = http.get("/console")
        assert page.status_code == 200
        linked = re.findall(r'(?:href|src)="(/[^"]*)"', page.text)
        assert any(path.startswith("/static/") and "icon" in path for path in linked), linked
        for path in ["/favicon.ico", *linked]:
            answer = http.get(path)
            assert answer.status_code == 200, (path, answer.status_code)
        assert http.get("/favicon.ico").headers["content-type"].startswith("image/svg+xml")
