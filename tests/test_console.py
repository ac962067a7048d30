"""The web console in a real browser: headless Chromium (the system's package, nothing downloaded) driven by
Playwright, against ``mpserve start --http`` with 2 instances × 2 slots of the tiny model behind an API key."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import ServerProcess
from helpers import CHROMIUM, chromium, free_port

from mpserve import Client

KEY = "console-test-key"
WAIT_MS = 30_000

sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests need playwright (pip install "
                               "playwright; no browser download: they use the system's chromium)")
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(f"no browser: {CHROMIUM} is missing (tests/run installs it: apt-get install chromium)",
                allow_module_level=True)



@pytest.fixture(scope="module")
def server() -> Iterator[tuple[ServerProcess, str]]:
    """The server and its gateway's URL. Two simulated GPUs with one permit each: one instance per GPU, and a
    computing request holds its GPU's permit."""
    port = free_port()
    proc = ServerProcess("--instances", "2", "--parallel", "2", "--n-ctx", "4096", "--max-active-per-gpu", "1",
                         "--http", f"127.0.0.1:{port}", "--api-key", KEY,
                         env={"MPSERVE_SIMULATE_GPUS": "2x24GiB"}).wait_ready()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:  # the gateway is a process of its own: wait until it answers
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the gateway did not answer:\n" + "\n".join(proc.log)
        time.sleep(0.1)
    yield proc, url
    proc.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as launched:
        yield launched


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context()  # its own session storage: no key carried over between tests
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    yield page
    context.close()


def open_with_key(page: Any, url: str) -> None:
    page.goto(url)
    page.fill("#key-input", KEY)
    page.click("#key-form button[type=submit]")
    page.wait_for_selector("#main", state="visible")


@pytest.mark.timeout(90)
def test_without_the_key_the_page_shows_only_its_prompt_and_a_wrong_key_is_refused(server, page) -> None:
    _, url = server
    assert httpx.get(f"{url}/console/state", timeout=10).status_code == 401
    assert httpx.get(f"{url}/console/state", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).status_code == 200
    page.goto(f"{url}/console")
    page.wait_for_selector("#key-form", state="visible")
    assert page.is_hidden("#main") and page.locator("#slots tbody tr").count() == 0
    page.fill("#key-input", "wrong")
    page.click("#key-form button[type=submit]")
    page.wait_for_function("document.getElementById('key-note').textContent.includes('refused')")
    assert page.is_hidden("#main") and page.locator("#slots tbody tr").count() == 0
    page.fill("#key-input", KEY)
    page.click("#key-form button[type=submit]")
    page.wait_for_selector("#slots tbody tr")
    assert page.evaluate("sessionStorage.getItem('mpserve-api-key')") == KEY


@pytest.mark.timeout(90)
def test_four_slot_rows_and_a_playground_completion_streams_in(server, page) -> None:
    proc, url = server
    open_with_key(page, url)
    page.wait_for_function("document.querySelectorAll('#slots tbody tr').length === 4")
    devices = page.locator("#slots tbody td[data-label=device]").all_text_contents()
    assert sorted(devices) == ["gpu0", "gpu0", "gpu1", "gpu1"]
    assert page.locator("#gpus .gpu").count() == 2
    # the host store's tiers once, said to be the host's; under its model, that model's counts only
    host = page.wait_for_selector("#models [data-store-host]")
    assert host.text_content().startswith("Host store (host-wide: every model and server on this host): RAM ")
    assert "of 256.0 MiB" in host.text_content() and page.locator("#models [data-store-host]").count() == 1
    store = page.wait_for_selector("#models [data-model] [data-store]")
    assert store.text_content().startswith("host store, this model: ") and "MiB" not in store.text_content()

    prompt = "The console shows"
    page.check("input[name=kind][value=completion]")
    page.fill("#play-prompt", prompt)
    page.fill("#play-max", "200")
    page.fill("#play-temp", "0")
    page.click("#play-send")
    page.wait_for_selector("#play-out[data-done=true]")
    with Client(proc.address, timeout=30) as client:
        expected = client.generate(prompt, max_tokens=200, temperature=0)
    assert page.text_content("#play-out") == expected.text
    assert int(page.get_attribute("#play-out", "data-chunks")) >= 2  # it came in pieces, as they were made
    timings = page.text_content("#play-timings")
    assert timings.startswith("done") and "200 tokens" in timings and "server: queue" in timings
    assert page.is_hidden("#play-error")
    page.wait_for_selector("#outcomes .chip[data-code=ok]")

    page.fill("#play-max", "0")  # refused by the server: its code and message are shown
    page.click("#play-send")
    page.wait_for_selector("#play-error", state="visible")
    assert page.text_content("#play-error").startswith("bad_request (HTTP 400)")
    page.wait_for_selector("#outcomes .chip[data-code=bad_request]")


@pytest.mark.timeout(90)
def test_a_slot_turns_busy_while_a_long_request_runs(server, page) -> None:
    proc, url = server
    open_with_key(page, url)
    page.wait_for_function("document.querySelectorAll('#slots tbody tr[data-state=idle]').length === 4")
    stop = threading.Event()

    def keep_one_running() -> None:  # back to back, so that a poll a second cannot miss them all
        while not stop.is_set():  # through the gateway, with the key: the console shows a key its own requests
            httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                       json={"model": "tiny", "prompt": "a long one", "max_tokens": 3000, "temperature": 0})

    runner = threading.Thread(target=keep_one_running, daemon=True)
    runner.start()
    try:
        busy = page.wait_for_selector("#slots tbody tr[data-state=busy]")
        assert busy.query_selector("td[data-label=request]").text_content() not in ("", "–")
        page.wait_for_function("[...document.querySelectorAll('#slots tr[data-state=busy] td[data-label=\"tok/s\"]')]"
                               ".some((td) => Number(td.textContent) > 0)")  # measured as it generates
        page.wait_for_function("[...document.querySelectorAll('[data-model=tiny] .figure')].some((f) => "
                               "f.textContent.endsWith('tokens/s') && parseFloat(f.textContent) > 0)")  # the series
        page.wait_for_selector("#gpus li:has-text('held by pid')")  # its instance holds its GPU's permit
    finally:
        stop.set()
        runner.join(60)
    page.wait_for_function("document.querySelectorAll('#slots tbody tr[data-state=idle]').length === 4")
