"""The overview's fleet health: nodes online, instances ready and what holds the rest, pipelines short of
replicas and the GPUs' use, on the page and again with every read of the gateway section (out of band)."""

import re

import pytest

from controlplane.accounts.models import Role
from controlplane.deployments.models import Instance
from controlplane.fleet.models import Gpu
from tests.controlplane.test_dashboard import a_small_fleet, logged_in

pytestmark = pytest.mark.django_db


def text(html: str) -> str:
    """The element's words, tags and runs of spaces left out."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", html)).strip()


def health_of(html: str) -> str:
    start = html.index('<div id="fleet-health"')
    return html[start : html.index("</div>", start) + len("</div>")]


def test_the_overview_shows_the_fleets_health() -> None:
    a_small_fleet()  # one node with a 24 GiB GPU; "chat" ready on it, "big" (4 GPUs) cannot be placed
    Gpu.objects.update(memory_used_bytes=6 * 2**30, utilization_percent=40)
    health = text(health_of(logged_in(Role.READ_ONLY).get("/").content.decode()))
    assert "1 of 1 node online" in health
    assert "1 of 2 instances ready, 1 starting" in health
    assert "2 pipelines running, 1 short of replicas" in health
    assert "1 GPU: memory 25% used" in health and "utilisation 40%" in health


def test_every_read_of_the_gateway_section_brings_the_fleets_health_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLOTILLA_GATEWAY_URL", raising=False)
    a_small_fleet()
    browser = logged_in(Role.READ_ONLY)
    before = health_of(browser.get("/gateway/").content.decode())
    assert 'hx-swap-oob="true"' in before and "failed" not in text(before)
    Instance.objects.filter(state="ready").update(state="failed")
    after = text(health_of(browser.get("/gateway/").content.decode()))
    assert "0 of 2 instances ready, 1 starting, 1 failed" in after
