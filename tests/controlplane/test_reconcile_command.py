"""``manage.py reconcile``: the pass without Celery's worker, tasks still through the broker."""

import io

import pytest
from celery import Celery
from django.core.management import CommandError, call_command
from kombu import Connection

from controlplane import celery_app
from controlplane.celery_app import create_app
from controlplane.deployments.models import Instance
from runtime.fleet_contract.tasks import TASK_START_INSTANCE
from tests.controlplane.factories import deploy, make_node
from tests.infra import RedisServer

pytestmark = pytest.mark.django_db


@pytest.fixture
def celery(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> Celery:
    app = create_app(redis_server.url)
    monkeypatch.setattr(celery_app, "app", app)
    return app


@pytest.mark.timeout(60)
def test_one_pass_places_and_sends_the_start_to_the_node(celery: Celery, redis_server: RedisServer) -> None:
    make_node("gpu-a", (80,))
    deploy("chat", gpus_per_replica=1)
    out = io.StringIO()

    call_command("reconcile", "--once", stdout=out)

    assert out.getvalue().strip() == "placed: 1; started: 1"
    with Connection(redis_server.url) as connection:
        queue = connection.SimpleQueue("node.gpu-a")
        message = queue.get(timeout=10)
        queue.close()
    assert message.headers["task"] == TASK_START_INSTANCE
    assert Instance.objects.get().dispatched_at is not None


@pytest.mark.parametrize("interval", ["0", "soon", "inf"])
def test_a_bad_interval_is_refused_naming_the_flag(interval: str) -> None:
    with pytest.raises(CommandError, match="--interval"):
        call_command("reconcile", "--once", "--interval", interval)


def test_a_bad_setting_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_NODE_TIMEOUT_S", "-3")
    with pytest.raises(CommandError, match=r"FLOTILLA_NODE_TIMEOUT_S=-3\.0 is below the minimum 1\.0"):
        call_command("reconcile", "--once")
