"""The banner on every dashboard page when the reconciler is late or Redis does not answer."""

import re
import time
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from controlplane.accounts.models import Role
from controlplane.deployments.reconciler import LEASE_NAME
from controlplane.health.models import ReconcilerPass
from controlplane.health.records import record_pass
from tests.controlplane.test_dashboard import logged_in
from tests.infra import RedisServer, free_port

pytestmark = pytest.mark.django_db


@pytest.fixture
def broker(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> RedisServer:
    monkeypatch.setenv("FLOTILLA_BROKER_URL", f"redis://:s3cret@127.0.0.1:{redis_server.port}/0")
    return redis_server


def a_pass_finished(seconds_ago: float) -> None:
    record_pass(LEASE_NAME, time.monotonic(), "nothing to do")
    ReconcilerPass.objects.update(finished_at=timezone.now() - timedelta(seconds=seconds_ago))


def banner(html: str) -> str:
    start = html.index('<div id="health-banner"')
    return html[start : html.index("</div>", start)]


@pytest.mark.parametrize("page", ["/", "/nodes/", "/pipelines/", "/models/"])
def test_a_late_reconciler_shows_on_every_page_with_what_to_check(broker: RedisServer, page: str) -> None:
    client = logged_in(Role.READ_ONLY)  # first: hashing the password takes a while
    a_pass_finished(seconds_ago=47)
    shown = banner(client.get(page).content.decode())
    # 47 s, and whatever the page took to render on a busy machine
    said = re.search(r"The reconciler has not run for (\d+) s: nothing is being restarted or placed", shown)
    assert said is not None, shown
    assert 47 <= int(said[1]) < 60
    assert "flotilla-celery-worker" in shown
    assert f"Redis at redis://:**@127.0.0.1:{broker.port}/0" in shown
    assert "s3cret" not in shown


def test_a_reconciler_that_never_ran_shows(broker: RedisServer) -> None:
    shown = banner(logged_in(Role.READ_ONLY).get("/").content.decode())
    assert "The reconciler has never finished a pass" in shown


def test_an_unreachable_broker_shows(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    monkeypatch.setenv("FLOTILLA_BROKER_URL", f"redis://127.0.0.1:{port}/0")
    a_pass_finished(seconds_ago=1)
    shown = banner(logged_in(Role.READ_ONLY).get("/").content.decode())
    assert f"Redis at redis://127.0.0.1:{port}/0 did not answer a PING" in shown
    assert "no task reaches an agent" in shown
    assert "reconciler has not run" not in shown


def test_nothing_shows_when_all_is_well_and_the_banner_refreshes_itself(broker: RedisServer) -> None:
    client = logged_in(Role.READ_ONLY)
    a_pass_finished(seconds_ago=1)
    shown = banner(client.get("/").content.decode())
    assert "<p" not in shown
    assert 'hx-get="/health-banner/"' in shown
    a_pass_finished(seconds_ago=60)
    refreshed = client.get("/health-banner/")
    assert refreshed.status_code == 200
    assert re.search(r"has not run for 6\d s", refreshed.content.decode())


def test_the_login_page_has_no_banner(broker: RedisServer) -> None:
    assert 'id="health-banner"' not in Client().get("/login/").content.decode()
