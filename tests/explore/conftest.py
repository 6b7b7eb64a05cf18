"""Fixtures for the explorer tests: a live server on 127.0.0.1 and a headless Chromium page.

The browser is Debian's `chromium` (`scripts/install-browser.sh` installs it; CI runs that script)
driven by the Playwright Python package. Playwright's own browser download is never used. When
Chromium or Playwright is missing the browser tests fail with the command that fixes it.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from fivefold.explore.server import start_in_thread

from .chromium import OFFLINE_ARGS, chromium_path
from .http_client import Client

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts" / "explore"
INSTALL_HINT = (
    "The explorer's browser tests need Debian's chromium: run `bash scripts/install-browser.sh` "
    "(apt-get install -y chromium) and `pip install -e '.[dev]'` for the playwright package. "
    "Set FIVEFOLD_CHROMIUM to use a chromium binary elsewhere."
)


@pytest.fixture(scope="module")
def server():
    srv, thread = start_in_thread(0)
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=5)


@pytest.fixture(scope="module")
def client(server) -> Client:
    return Client(server.url)


@pytest.fixture(scope="module")
def browser():
    path = chromium_path()
    if path is None:
        pytest.fail(f"chromium is not installed. {INSTALL_HINT}", pytrace=False)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(f"the playwright package is not installed. {INSTALL_HINT}", pytrace=False)
    profile = tempfile.mkdtemp(prefix="fivefold-chromium-")
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile,
            executable_path=path,
            headless=True,
            args=OFFLINE_ARGS,
            viewport={"width": 1500, "height": 1000},
            accept_downloads=True,
        )
        context.set_default_timeout(30_000)
        yield context
        context.close()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def page(browser, server):
    """A fresh tab on the explorer; fails the test on any JavaScript error or console error."""
    tab = browser.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda err: errors.append(f"page error: {err}"))

    def on_console(msg) -> None:
        # Chromium logs every 4xx answer as "Failed to load resource"; a 400 is how the API
        # reports an invalid layout, which the page then shows. Anything else is a bug.
        if msg.type == "error" and "status of 400 (Bad Request)" not in msg.text:
            errors.append(f"console {msg.type}: {msg.text}")

    tab.on("console", on_console)
    outside: list[str] = []
    tab.on(
        "request",
        lambda req: (
            None if req.url.startswith((server.url, "blob:", "data:")) else outside.append(req.url)
        ),
    )
    tab.goto(server.url)
    tab.wait_for_selector("body[data-state=ready]")
    yield tab
    raw = unfilled_placeholders(tab)
    tab.close()
    assert not errors, errors
    assert not raw, f"the page shows raw template text: {raw}"
    assert not outside, f"the page reached outside the local server: {outside}"


def unfilled_placeholders(tab) -> list[str]:
    """Lines of the page's visible text that hold a JavaScript `${...}` placeholder."""
    text = tab.evaluate("() => document.body.innerText")
    return [line for line in text.splitlines() if "${" in line]


def screenshot(tab, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    tab.screenshot(path=str(path), full_page=True)
    return path
