"""A keyless gateway on loopback is safe from the web pages its user opens: in headless Chromium (the system's
package, driven by Playwright as in test_console), a page of another origin can neither fetch from it nor
reach it with a form POST or a "simple" no-cors POST (nothing reaches the broker); a page of an origin in
--allowed-origins can, with CORS headers; a Host that is not the gateway's (DNS rebinding) is refused; a
POST body that is not JSON is refused; the gateway's own page still calls it.
"""

from __future__ import annotations

import http.server
import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import ServerProcess
from gateway_thread import GatewayThread
from helpers import CHROMIUM, chromium

from mpserve import Client

WAIT_MS = 20_000
BODY = {"prompt": "hello", "max_tokens": 4}

sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests need playwright (pip install "
                               "playwright; no browser download: they use the system's chromium)")
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(f"no browser: {CHROMIUM} is missing (tests/run installs it: apt-get install chromium)",
                allow_module_level=True)

PAGES: dict[str, str] = {}  # path -> HTML, served on two ports of 127.0.0.1: two other origins on loopback


class _Pages(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the http.server name)
        body = PAGES.get(self.path, "<p>a page</p>").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def origin_server() -> str:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pages)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


EVIL = origin_server()
FRIEND = origin_server()


@pytest.fixture(scope="module")
def front(tiny_server: ServerProcess) -> Iterator[GatewayThread]:
    gw = GatewayThread(server_name=tiny_server.name, allowed_origins=(FRIEND,))
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as launched:
        yield launched


def page_at(browser: Any, origin: str, html: str = "<p>a page</p>") -> Any:
    """A page of ``origin`` holding ``html``."""
    PAGES[f"/{id(html)}"] = html
    page = browser.new_context().new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(f"{origin}/{id(html)}")
    return page


def accepted(server: ServerProcess) -> int:
    with Client(server.address) as client:
        counters = client.stats().counters
    return counters.get("accepted", 0) + counters.get("slot_erase", 0)


FETCH = """async ([url, body, mode, type]) => {
    try {
        const r = await fetch(url, {method: "POST", mode, body, headers: {"Content-Type": type}});
        return mode === "no-cors" ? "sent" : `${r.status} ${await r.text()}`;
    } catch (e) { return `refused: ${e}`; }
}"""


@pytest.mark.timeout(120)
def test_a_page_of_another_origin_can_neither_fetch_nor_post_a_form(front: GatewayThread, browser: Any,
                                                                       tiny_server: ServerProcess) -> None:
    before = accepted(tiny_server)
    form = (f'<form id="f" method="POST" enctype="text/plain" action="{front.url}/v1/completions">'
            f'<input name=\'{{"prompt": "x", "max_tokens": 4, "p": "\' value=\'"}}\'></form>'
            f'<form id="e" method="POST" action="{front.url}/slots/0?action=erase"></form>')
    page = page_at(browser, EVIL, form)
    try:
        url = f"{front.url}/v1/completions"
        assert page.evaluate(FETCH, [url, json.dumps(BODY), "cors", "application/json"]).startswith("refused")
        page.evaluate(FETCH, [url, json.dumps(BODY), "no-cors", "text/plain"])  # opaque: judged by its effect
        with page.expect_navigation():
            page.evaluate("document.getElementById('f').submit()")
        assert page.evaluate("document.body.innerText").count("cross_origin") == 1
        page.go_back()
        with page.expect_navigation():
            page.evaluate("document.getElementById('e').submit()")
        assert "cross_origin" in page.evaluate("document.body.innerText")
    finally:
        page.context.close()
    assert accepted(tiny_server) == before, "a request from another origin's page reached the broker"


@pytest.mark.timeout(120)
def test_an_allowed_origin_and_the_gateways_own_page_may_call_it(front: GatewayThread, browser: Any) -> None:
    page = page_at(browser, FRIEND)
    try:
        got = page.evaluate(FETCH, [f"{front.url}/v1/completions", json.dumps(BODY), "cors", "application/json"])
        assert got.startswith("200 ") and json.loads(got[4:])["usage"]["completion_tokens"] == 4
    finally:
        page.context.close()
    own = browser.new_context().new_page()
    try:
        own.goto(f"{front.url}/")  # the console's origin: the gateway's own
        got = own.evaluate(FETCH, [f"{front.url}/v1/completions", json.dumps(BODY), "cors", "application/json"])
        assert got.startswith("200 "), got
    finally:
        own.context.close()
    preflight = httpx.options(f"{front.url}/v1/completions", headers={
        "Origin": FRIEND, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"}, timeout=10)
    assert preflight.status_code == 204 and preflight.headers["access-control-allow-origin"] == FRIEND
    assert "access-control-allow-origin" not in front.get("/health", headers={"Origin": EVIL}).headers


@pytest.mark.timeout(60)
def test_a_foreign_host_and_a_body_that_is_not_json_are_refused(front: GatewayThread,
                                                                tiny_server: ServerProcess) -> None:
    before = accepted(tiny_server)
    rebound = httpx.post(f"{front.url}/v1/completions", json=BODY, headers={"Host": "evil.example"}, timeout=10)
    assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "invalid_host"
    assert front.get("/health", headers={"Host": "evil.example:8000"}).status_code == 403
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        refused = httpx.post(f"{front.url}/v1/completions", content=json.dumps(BODY),
                             headers={"Content-Type": content_type}, timeout=10)
        assert refused.status_code == 415 and refused.json()["error"]["code"] == "unsupported_media_type"
    assert accepted(tiny_server) == before
    for host in ("localhost", "127.0.0.1", f"localhost:{front.url.rsplit(':', 1)[1]}"):
        assert front.get("/health", headers={"Host": host}).status_code in (200, 503)
    done = httpx.post(f"{front.url}/v1/completions", json=BODY, timeout=30)
    assert done.status_code == 200, done.text
