"""The control plane's Celery side against a real Redis: what reaches queue node.<name>, a pass run by a
Celery worker, and the log-tail endpoint answered (or not) by a tiny agent-like worker."""

import logging
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from kombu import Connection, Message
from rest_framework.test import APIClient

from controlplane import celery_app
from controlplane.celery_app import RECONCILE_TASK, create_app, send_reconcile_request
from controlplane.deployments.dispatch import CeleryDispatcher, DispatchError
from controlplane.deployments.models import Instance
from controlplane.deployments.reconciler import Reconciler, ReconcilerSettings
from controlplane.deployments.upkeep import place_pending_instances
from runtime.fleet_contract.signing import agent_signing_key, signature_ok
from runtime.fleet_contract.tasks import (
    CONTROL_PLANE_QUEUE,
    TASK_LOG_TAIL,
    TASK_START_INSTANCE,
    LogTailRequest,
    StartInstance,
    decode_task_argument,
)
from tests.controlplane.factories import TEST_ACTOR, agent_token, deploy, make_node
from tests.infra import RedisServer
from tests.servers import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def celery(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> Celery:
    """The control plane's app on the test's Redis, as FLOTILLA_BROKER_URL would make it."""
    app = create_app(redis_server.url)
    monkeypatch.setattr(celery_app, "app", app)
    return app


@pytest.fixture
def agent_worker(redis_server: RedisServer) -> Iterator[list[dict[str, Any]]]:
    """A Celery worker on queue node.gpu-a that answers log tails as an agent would; yields the requests."""
    # An agent has no Django: no Django fix-up (it would close the test's database connections).
    agent = Celery("agent-gpu-a", broker=redis_server.url, backend=redis_server.url, fixups=[])
    agent.conf.update(accept_content=["json"], result_accept_content=["json"], task_serializer="json")
    requests: list[dict[str, Any]] = []

    # Not shared: a shared task would be added to every Celery app made later in this process (the
    # agent consumer's tests too), and answer for it.
    @agent.task(name=TASK_LOG_TAIL, shared=False)
    def log_tail(payload: dict[str, Any]) -> str:
        requests.append(payload)
        request = decode_task_argument(payload, LogTailRequest)
        return "".join(f"line {n} of instance {request.instance_id}\n" for n in range(request.lines))

    with start_worker(agent, queues=["node.gpu-a"], pool="solo", perform_ping_check=False, loglevel="WARNING"):
        yield requests


def next_message(url: str, queue: str) -> Message:
    with Connection(url) as connection:
        simple = connection.SimpleQueue(queue)
        try:
            message: Message = simple.get(timeout=10)
            message.ack()
        finally:
            simple.close()
    return message


@pytest.mark.django_db
def test_a_pass_puts_the_start_instance_json_on_the_nodes_queue_signed_for_its_agent(
    celery: Celery, redis_server: RedisServer
) -> None:
    make_node("gpu-a", (80,))
    old_token, new_token = agent_token("gpu-a"), agent_token("gpu-a")  # one being replaced by the other
    agent_token("gpu-b")
    deploy("chat", gpus_per_replica=1)

    report = Reconciler(CeleryDispatcher(celery), ReconcilerSettings()).run_once()

    assert report is not None and report.started == 1
    message = next_message(redis_server.url, "node.gpu-a")
    assert message.headers["task"] == TASK_START_INSTANCE
    assert message.content_type == "application/json"
    args, kwargs, _ = message.decode()
    start = decode_task_argument(args[0], StartInstance)
    assert start.spec.instance_id == Instance.objects.get().pk
    assert (start.spec.pipeline, start.spec.gpu_indexes, start.attempt, start.node) == ("chat", [0], 0, "gpu-a")
    assert start.incarnation == Instance.objects.get().incarnation
    assert kwargs == {}
    # Valid for the resend time on the control plane's clock, inside the signature; no Celery expiry, which
    # the agent would judge on its own clock.
    assert len(start.nonce) == 32 and abs(start.issued_at - time.time()) < 60
    assert start.valid_for_s == ReconcilerSettings().resend_after_s
    assert message.headers.get("expires") is None
    # Each of the node's agents can tell it came from the control plane; another node's agent cannot.
    assert len(start.signatures) == 2
    assert signature_ok(TASK_START_INSTANCE, args[0], agent_signing_key(old_token, "gpu-a"))
    assert signature_ok(TASK_START_INSTANCE, args[0], agent_signing_key(new_token, "gpu-a"))
    assert not signature_ok(TASK_START_INSTANCE, args[0], agent_signing_key(new_token, "gpu-b"))


def test_a_reconcile_request_lands_on_the_control_planes_queue(celery: Celery, redis_server: RedisServer) -> None:
    assert send_reconcile_request(celery)
    message = next_message(redis_server.url, CONTROL_PLANE_QUEUE)
    assert message.headers["task"] == RECONCILE_TASK


def test_a_reconcile_request_without_a_broker_is_dropped_quietly(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="controlplane.celery_app")
    dead = create_app(f"redis://127.0.0.1:{free_port()}/0")
    assert not send_reconcile_request(dead)
    assert "the periodic pass will come" in caplog.text


@pytest.mark.django_db  # the node's keys are read to sign the start
def test_a_start_without_a_broker_is_a_dispatch_error() -> None:
    dead = create_app(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(DispatchError, match=r"did not take flotilla\.agent\.start_instance for node gpu-a"):
        CeleryDispatcher(dead).start_instance("gpu-a", msgspec.convert(_START, StartInstance), expires_s=5)


@pytest.mark.django_db(transaction=True)  # the worker's thread reads what the test wrote
def test_a_celery_worker_runs_the_pass_and_the_start_reaches_the_node(
    celery: Celery, redis_server: RedisServer
) -> None:
    make_node("gpu-a", (80,))
    deploy("chat", gpus_per_replica=1)

    with start_worker(celery, queues=[CONTROL_PLANE_QUEUE], pool="solo", perform_ping_check=False, loglevel="WARNING"):
        assert send_reconcile_request(celery)
        message = next_message(redis_server.url, "node.gpu-a")

    assert message.headers["task"] == TASK_START_INSTANCE
    assert Instance.objects.get().dispatched_at is not None


@pytest.mark.django_db
def test_the_log_endpoint_returns_what_the_nodes_agent_answers(
    celery: Celery, agent_worker: list[dict[str, Any]], reader: APIClient
) -> None:
    instance = _placed_instance()

    response = reader.get(f"/api/v1/instances/{instance.pk}/log/?lines=2")

    assert response.status_code == 200, response.content
    assert response.json() == {
        "instance": instance.pk,
        "node": "gpu-a",
        "lines": 2,
        "text": f"line 0 of instance {instance.pk}\nline 1 of instance {instance.pk}\n",
    }
    (asked,) = agent_worker
    assert {key: asked[key] for key in ("instance_id", "lines", "signatures")} == {
        "instance_id": instance.pk,
        "lines": 2,
        "signatures": {},  # gpu-a has no token here
    }
    assert asked["nonce"] and asked["valid_for_s"] > 0


@pytest.mark.django_db
def test_the_log_endpoint_says_which_node_did_not_answer(
    celery: Celery, reader: APIClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLOTILLA_LOG_TAIL_TIMEOUT_S", "0.5")
    instance = _placed_instance()

    response = reader.get(f"/api/v1/instances/{instance.pk}/log/")

    assert response.status_code == 503
    assert response.json() == {"detail": "node gpu-a did not answer in 0.5 s"}


_START = {"spec": {"instance_id": 1, "pipeline": "chat", "group": "aggregated", "replica": 0, "engine": "mocker"}}


def _placed_instance() -> Instance:
    make_node("gpu-a", (80,))
    deploy("chat", gpus_per_replica=1)
    place_pending_instances(TEST_ACTOR)
    return Instance.objects.get()
