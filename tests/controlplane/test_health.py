"""``/api/v1/health/``: 200 when database, broker and reconciler are up, 503 naming what is down, in time."""

import os
import signal
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.accounts.models import Role
from controlplane.deployments.reconciler import LEASE_NAME
from controlplane.fleet.models import Node
from controlplane.health.models import ReconcilerPass
from controlplane.health.records import record_pass
from tests.controlplane.factories import make_node
from tests.controlplane.reconciling import Clock, RecordingDispatcher, make_reconciler
from tests.infra import RedisServer, free_port

pytestmark = pytest.mark.django_db


@pytest.fixture
def broker(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> RedisServer:
    """The control plane's broker is the test's Redis, reached with a password in its URL (which must
    never be shown)."""
    monkeypatch.setenv("FLOTILLA_BROKER_URL", f"redis://:s3cret@127.0.0.1:{redis_server.port}/0")
    return redis_server


@pytest.fixture
def frozen(broker: RedisServer) -> Iterator[RedisServer]:
    """The broker's process stopped with SIGSTOP: it accepts connections and never answers."""
    assert broker.process is not None
    os.kill(broker.process.pid, signal.SIGSTOP)
    yield broker
    os.kill(broker.process.pid, signal.SIGCONT)


def a_pass_finished(seconds_ago: float = 0.0) -> None:
    record_pass(LEASE_NAME, time.monotonic(), "nothing to do")
    if seconds_ago:
        moved = timezone.now() - timedelta(seconds=seconds_ago)
        ReconcilerPass.objects.update(finished_at=moved, started_at=moved)


def timed_get(client: APIClient) -> tuple[int, dict, float]:
    started = time.monotonic()
    response = client.get("/api/v1/health/")
    return response.status_code, response.json(), time.monotonic() - started


def test_everything_up_is_200_with_each_check_ok(broker: RedisServer, client_for: Callable) -> None:
    make_node("gpu-a")
    make_node("gpu-b")
    Node.objects.filter(name="gpu-b").update(state=Node.State.OFFLINE)
    a_pass_finished()
    status, body, _ = timed_get(client_for(Role.READ_ONLY))
    assert status == 200, body
    assert body["status"] == "ok"
    assert body["database"] == {"ok": True, "error": ""}
    assert body["broker"] == {"ok": True, "error": "", "url": f"redis://:**@127.0.0.1:{broker.port}/0"}
    reconciler = body["reconciler"]
    assert (reconciler["ok"], reconciler["late"], reconciler["summary"]) == (True, False, "nothing to do")
    assert 0 <= reconciler["age_s"] < 5
    assert reconciler["late_after_s"] == 3 * 2.0 + 10
    assert (body["agents"]["online"], body["agents"]["offline"]) == (1, 1)
    assert 0 <= body["agents"]["last_heartbeat_age_s"] < 60


def test_a_reconciler_pass_is_recorded_by_the_reconciler_itself(broker: RedisServer) -> None:
    make_reconciler(RecordingDispatcher(), Clock()).run_once()
    status, body, _ = timed_get(APIClient())
    assert status == 200, body
    assert body["reconciler"]["late"] is False
    assert body["reconciler"]["duration_s"] >= 0
    assert ReconcilerPass.objects.get(name=LEASE_NAME).passes == 1


def test_a_closed_broker_port_is_503_naming_the_broker_within_a_second(
    monkeypatch: pytest.MonkeyPatch, client_for: Callable
) -> None:
    monkeypatch.setenv("FLOTILLA_BROKER_URL", f"redis://:s3cret@127.0.0.1:{free_port()}/0")
    a_pass_finished()
    status, body, took = timed_get(client_for(Role.READ_ONLY))
    assert status == 503
    assert took < 1.0
    assert (body["status"], body["broker"]["ok"], body["reconciler"]["ok"]) == ("down", False, True)
    assert "did not answer a PING" in body["broker"]["error"]
    assert "s3cret" not in str(body)


def test_a_frozen_broker_is_503_within_a_second(frozen: RedisServer) -> None:
    a_pass_finished()
    status, body, took = timed_get(APIClient())
    assert (status, body["status"], body["broker"]["ok"]) == (503, "down", False)
    assert took < 1.0


def test_a_stopped_broker_is_503(broker: RedisServer) -> None:
    a_pass_finished()
    broker.stop()
    status, body, _ = timed_get(APIClient())
    assert (status, body["broker"]["ok"]) == (503, False)


def test_an_old_last_pass_is_late_and_503(broker: RedisServer, client_for: Callable) -> None:
    a_pass_finished(seconds_ago=47)
    status, body, _ = timed_get(client_for(Role.READ_ONLY))
    assert status == 503
    reconciler = body["reconciler"]
    assert (reconciler["ok"], reconciler["late"]) == (False, True)
    assert 47 <= reconciler["age_s"] < 60
    assert reconciler["error"].endswith("s ago (late after 16 s)")


def test_a_reconciler_that_never_ran_is_late(broker: RedisServer) -> None:
    status, body, _ = timed_get(APIClient())
    assert status == 503
    assert body["reconciler"] == {
        "ok": False,
        "last_pass_at": None,
        "age_s": None,
        "late": True,
        "late_after_s": 16.0,
        "duration_s": None,
    }


def test_without_a_token_it_says_states_but_no_reasons_urls_or_summaries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_BROKER_URL", f"redis://:s3cret@127.0.0.1:{free_port()}/0")
    a_pass_finished()
    status, body, _ = timed_get(APIClient())
    assert status == 503
    assert body["broker"] == {"ok": False}
    assert "error" not in body["reconciler"] and "summary" not in body["reconciler"]
    assert "127.0.0.1" not in str(body)


def test_the_openapi_schema_documents_it() -> None:
    schema = APIClient().get("/api/v1/schema/", HTTP_ACCEPT="application/json").json()
    answers = schema["paths"]["/api/v1/health/"]["get"]["responses"]
    assert {"200", "503"} <= set(answers)
