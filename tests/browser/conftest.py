"""One fleet with its live bridge and one Chromium per test module, and an operator logged in through the
login form.

The fleet is tests/fleet/stack.py's (Redis, etcd, NATS, the control plane under uvicorn with its
reconciler, two agents with simulated GPUs, the gateway), plus ``manage.py live_bridge``; metric samples and
alert passes come every second.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from playwright.sync_api import Browser, BrowserContext, Page, sync_playwright

from tests.agent.fake_hub import running_hub
from tests.browser.chromium import TIMEOUT_MS, VIEWPORT, create_person, launch, log_in
from tests.browser.live_bridge import LiveBridge
from tests.fleet.stack import FleetStack
from tests.infra import EtcdServer, NatsServer, RedisServer

OPERATOR, READER = "olive-operator", "rita-reader"
#: The one repo of the fleet's stand-in hub.
HUB_REPO = "acme/smol-chat-GGUF"
PASSWORD = "browser-tests-password-not-secret"


@dataclass
class LiveFleet:
    """The fleet, its bridge and the dashboard's address."""

    stack: FleetStack
    bridge: LiveBridge

    @property
    def url(self) -> str:
        return self.stack.control_plane.url

    def logs(self) -> str:
        return f"{self.stack.logs()}\n--- live bridge ---\n{self.bridge.log()[-3000:]}"


@pytest.fixture(scope="module")
def live_fleet(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> Iterator[LiveFleet]:
    directory = tmp_path_factory.mktemp("browser-fleet")
    servers = (RedisServer(directory / "redis"), EtcdServer(directory / "etcd"), NatsServer(directory / "nats"))
    for server in servers:
        server.start()
    stack = FleetStack(directory, *servers, smollm2)
    # A metric sample every second and an alert pass every second (the live bridge and the Celery worker's beat
    # read these), rather than every 10 s and 15 s: the walk's seconds of traffic then show in the history
    # charts and fire the TTFT alert.
    stack.control_plane.env |= {"FLOTILLA_METRICS_SAMPLE_S": "1", "FLOTILLA_ALERT_EVERY_S": "1"}
    # The Models page's Hugging Face search asks a hub on loopback that holds one GGUF repo (the machine has no
    # network); the walk's models are local files, which no agent fetches from it.
    hub_running = running_hub()
    hub = hub_running.__enter__()
    hub.repos[HUB_REPO] = {"smol-Q4_K_M.gguf": b"q" * 4096}
    hub.cards[HUB_REPO] = {"downloads": 42, "tags": ["gguf"], "gguf": {"context_length": 8192}}
    stack.control_plane.env |= {"HF_ENDPOINT": hub.url, "HF_HUB_ETAG_TIMEOUT": "5"}
    bridge = LiveBridge(stack.control_plane, servers[2].url, directory / "live-bridge.log")
    try:
        stack.start()
        bridge.start()
        create_person(stack.control_plane, OPERATOR, "operator", PASSWORD)
        create_person(stack.control_plane, READER, "read_only", PASSWORD)
        yield LiveFleet(stack, bridge)
    finally:
        bridge.stop()
        stack.stop()
        for server in servers:
            server.stop()
        hub_running.__exit__(None, None, None)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        chromium = launch(playwright)
        yield chromium
        chromium.close()


def new_context(browser: Browser) -> BrowserContext:
    """A fresh browser profile (no cookies) with a laptop's viewport and the tests' timeouts."""
    context = browser.new_context(viewport=VIEWPORT)
    context.set_default_timeout(TIMEOUT_MS)
    return context


@pytest.fixture
def anonymous(browser: Browser) -> Iterator[BrowserContext]:
    context = new_context(browser)
    yield context
    context.close()


def logged_in_page(browser: Browser, live_fleet: LiveFleet, username: str) -> Iterator[Page]:
    """A page of a fresh profile, logged in as ``username`` through the login form; the test fails if the
    page raised an uncaught script error or htmx logged one (htmx:oobErrorNoTarget: a push for an element the
    page does not show)."""
    context = new_context(browser)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda message: errors.append(message.text) if "htmx:" in message.text else None)
    page.on("dialog", lambda dialog: dialog.accept())  # htmx's hx-confirm asks before a stop
    log_in(page, live_fleet.url, username, PASSWORD)
    yield page
    context.close()
    assert not errors, f"script errors in the page: {errors}"


@pytest.fixture
def operator_page(browser: Browser, live_fleet: LiveFleet) -> Iterator[Page]:
    yield from logged_in_page(browser, live_fleet, OPERATOR)


@pytest.fixture
def reader_page(browser: Browser, live_fleet: LiveFleet) -> Iterator[Page]:
    yield from logged_in_page(browser, live_fleet, READER)
