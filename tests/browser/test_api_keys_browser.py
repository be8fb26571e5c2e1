"""API keys in Chromium, end to end: an operator makes a key on the dashboard's API keys page, an
application calls a real gateway with it through the official ``openai`` client, its usage appears on the
Usage page once the control plane's Celery beat has drained the gateway's counts from Redis, and after the
operator revokes it the gateway refuses it (401).

The stack is the serving path with keys on, as ``flotilla up`` runs it: Redis, etcd and NATS; a gateway
(``out=dyn --api-keys-secret-file --quota-redis``) and an echo worker; the control plane under uvicorn and
its Celery worker with beat, given the same secret, etcd and Redis (``FLOTILLA_USAGE_DRAIN_S=1``).
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from playwright.sync_api import Browser, Page, expect

from tests.agent.control_plane_server import REPOSITORY, ControlPlaneServer, wait_for
from tests.browser.chromium import create_person
from tests.browser.conftest import PASSWORD, logged_in_page
from tests.distributed.cluster import Cluster
from tests.infra import EtcdServer, NatsServer, RedisServer
from tests.servers import Server, stop_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCREENSHOTS = Path(os.environ.get("FLOTILLA_SCREENSHOTS") or tempfile.mkdtemp(prefix="flotilla-screenshots-"))
OPERATOR, MODEL = "kim-operator", "echo"


@dataclass
class KeyedFleet:
    """The control plane (with its beat) and a gateway that requires keys, sharing a signing secret."""

    control_plane: ControlPlaneServer
    gateway: Server
    beat_log: Path

    @property
    def url(self) -> str:
        return self.control_plane.url

    def logs(self) -> str:
        beat = self.beat_log.read_text(errors="replace")[-3000:] if self.beat_log.exists() else ""
        return f"--- gateway ---\n{self.gateway.log()[-3000:]}\n--- celery ---\n{beat}"


@pytest.fixture(scope="module")
def keyed_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedFleet]:
    directory = tmp_path_factory.mktemp("api-keys-browser")
    redis, etcd, nats = RedisServer(directory / "redis"), EtcdServer(directory / "etcd"), NatsServer(directory / "nats")
    for server in (redis, etcd, nats):
        server.start()
    secret = directory / "api-keys.secret"
    secret.write_text(os.urandom(32).hex() + "\n")
    secret.chmod(0o600)
    cluster = Cluster(etcd, nats, directory / "serving")
    cluster.directory.mkdir()
    beat: subprocess.Popen[bytes] | None = None
    control_plane = ControlPlaneServer(directory / "controlplane", broker_url=redis.url)
    try:
        gateway = cluster.start_ingress("--api-keys-secret-file", str(secret), "--quota-redis", redis.url)
        cluster.start_worker(f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL)
        wait_for("the gateway to serve the echo model", lambda: _serves(gateway), 30, explain=gateway.log)
        control_plane.env |= {
            "ETCD_ENDPOINTS": etcd.endpoint,
            "FLOTILLA_API_KEYS_SECRET_FILE": str(secret),
            "FLOTILLA_QUOTA_REDIS_URL": redis.url,
            "FLOTILLA_USAGE_DRAIN_S": "1",
            "FLOTILLA_GATEWAY_URL": gateway.base_url,
        }
        control_plane.start()
        beat_log = directory / "celery.log"
        command = [sys.executable, "-m", "celery", "-A", "controlplane.celery_app", "worker", "-B"]
        command += ["-Q", "controlplane", "--concurrency", "1", "--pool", "solo", "--loglevel", "info"]
        command += ["-s", str(directory / "controlplane" / "celerybeat-schedule")]
        with beat_log.open("ab") as log_file:
            beat = subprocess.Popen(
                command, cwd=REPOSITORY, env=control_plane.env, stdout=log_file, stderr=subprocess.STDOUT
            )
        create_person(control_plane, OPERATOR, "operator", PASSWORD)
        yield KeyedFleet(control_plane, gateway, beat_log)
    finally:
        if beat is not None:
            stop_process(beat, signal.SIGTERM, timeout=20)
        control_plane.stop()
        cluster.stop()
        for server in (redis, etcd, nats):
            server.stop()


def _serves(gateway: Server) -> bool:
    return MODEL in httpx.get(gateway.base_url + "/health", timeout=5).json().get("models", [])


@pytest.fixture
def operator_page(browser: Browser, keyed_fleet: KeyedFleet) -> Iterator[Page]:
    yield from logged_in_page(browser, keyed_fleet, OPERATOR)  # type: ignore[arg-type]


def ask(gateway: Server, key: str) -> str:
    client = openai.OpenAI(base_url=gateway.api_url, api_key=key, max_retries=0, timeout=30)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello keys"}])
    return reply.choices[0].message.content or ""


def accepted(gateway: Server, key: str) -> bool:
    """Whether the gateway answers ``key`` (it learns of a new key from etcd within milliseconds)."""
    try:
        ask(gateway, key)
    except openai.AuthenticationError:
        return False
    return True


def refused(gateway: Server, key: str) -> str:
    """The refusal (status, code and message) once the gateway refuses ``key``; "" while it still answers."""
    try:
        ask(gateway, key)
    except openai.AuthenticationError as exc:
        return f"{exc.status_code} {exc.code}: {exc.message}"
    return ""


def requests_shown(page: Page) -> int:
    page.reload()
    return int(page.locator("#usage-requests").inner_text())


def test_an_operator_makes_a_key_sees_its_usage_and_revokes_it(keyed_fleet: KeyedFleet, operator_page: Page) -> None:
    page, base, gateway = operator_page, keyed_fleet.url, keyed_fleet.gateway
    with pytest.raises(openai.AuthenticationError):
        ask(gateway, "sk-flt-not-a-key")

    nav = page.locator("header nav")
    nav.get_by_role("link", name="API keys").click()
    expect(page).to_have_url(base + "/api-keys/")
    page.locator("#id_name").fill("browser-app")
    page.get_by_label("Other model names").fill(MODEL)
    page.get_by_label("Requests per minute").fill("600")
    page.get_by_role("button", name="Make the key").click()
    expect(page.locator("#created-key")).to_contain_text("shown this once")
    key = page.locator("#new-key").inner_text()
    assert key.startswith("sk-flt-")
    expect(page.locator("#snippet-python")).to_contain_text(f'OpenAI(base_url="{gateway.api_url}", api_key="{key}")')
    copy = page.locator("#created-key button[data-copy='#new-key']")
    copy.click()
    # Copied, or (where the browser allows neither clipboard way) selected for Ctrl+C.
    expect(copy).to_have_text(re.compile(r"^(Copied|Selected: press Ctrl\+C)$"))
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / "api-keys.png")

    wait_for("the gateway to accept the new key", lambda: accepted(gateway, key), 10, explain=keyed_fleet.logs)
    for _ in range(2):
        assert "hello keys" in ask(gateway, key)

    nav.get_by_role("link", name="Usage").click()
    expect(page).to_have_url(base + "/usage/")
    shown = wait_for(
        "the key's usage on the Usage page", lambda: requests_shown(page) >= 3, 30, explain=keyed_fleet.logs
    )
    assert shown
    expect(page.locator("#usage-table")).to_contain_text("browser-app")
    expect(page.locator("#usage-table")).to_contain_text(MODEL)
    expect(page.locator(".usage-chart canvas")).to_have_count(2)  # uPlot drew both charts
    assert int(page.locator("#usage-prompt-tokens").inner_text()) > 0
    page.locator("input[name='measure'][value='requests']").check()
    expect(page.locator(".usage-chart canvas")).to_have_count(2)
    page.screenshot(path=SCREENSHOTS / "usage.png", full_page=True)
    with page.expect_download() as download:
        page.locator("#usage-csv").click()
    lines = Path(download.value.path()).read_text().splitlines()
    assert lines[0].startswith("day,key,key_name,owner,model,requests") and any(
        ",browser-app," in line for line in lines
    )

    nav.get_by_role("link", name="API keys").click()
    row = page.locator(".tr", has_text="browser-app")
    row.get_by_role("button", name="Revoke").click()  # the page's dialog handler confirms
    expect(page.locator("#flash")).to_contain_text("browser-app")
    expect(page.locator("#flash")).to_contain_text("is revoked")
    expect(page.locator(".tr", has_text="browser-app")).to_contain_text("revoked")
    message = wait_for("the gateway to refuse the revoked key", lambda: refused(gateway, key), 5)
    assert message.startswith("401 invalid_api_key: ") and "was revoked" in message
