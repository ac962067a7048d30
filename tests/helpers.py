"""Helpers shared by the tests."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float = 10.0, what: str = "the condition",
             interval: float = 0.01) -> T:
    """Poll ``condition`` until it returns something truthy, and return that; fail naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(interval)
    return value


def http_up(url: str) -> bool:
    """Whether the gateway at ``url`` answers /health with 200 (ready)."""
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def free_port() -> int:
    """A TCP port of 127.0.0.1 that no one listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


CHROMIUM = "/usr/bin/chromium"  # the system's package: the browser tests download no browser
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """Headless Chromium, driven by Playwright (imported here: only the browser tests need it)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()
