"""GET /api/v1/instances/<id>/log/: the tail of a worker's log, asked of its node's agent."""

from collections.abc import Callable

import pytest
from rest_framework.test import APIClient

from controlplane.accounts.models import Role
from controlplane.deployments.dispatch import AgentFailed
from controlplane.deployments.models import Instance
from controlplane.fleet.models import Node
from tests.controlplane.factories import deploy, placed_instance
from tests.controlplane.reconciling import RecordingDispatcher

pytestmark = pytest.mark.django_db


def test_the_log_is_asked_of_the_instances_node(log_dispatcher: RecordingDispatcher, reader: APIClient) -> None:
    instance = placed_instance()
    response = reader.get(f"/api/v1/instances/{instance.pk}/log/?lines=20")
    assert response.status_code == 200
    assert response.json()["text"] == f"the last 20 lines of instance {instance.pk}"
    [sent] = log_dispatcher.sent
    assert (sent.queue, sent.expires_s) == ("node.gpu-a", 5.0)


def test_an_unplaced_instance_has_no_log(log_dispatcher: RecordingDispatcher, reader: APIClient) -> None:
    deploy("chat")
    instance = Instance.objects.get()
    response = reader.get(f"/api/v1/instances/{instance.pk}/log/")
    assert response.status_code == 409
    assert "is not placed on a node" in response.json()["detail"]
    assert log_dispatcher.sent == []


def test_an_offline_node_is_not_asked(log_dispatcher: RecordingDispatcher, reader: APIClient) -> None:
    instance = placed_instance()
    Node.objects.update(state=Node.State.OFFLINE)
    response = reader.get(f"/api/v1/instances/{instance.pk}/log/")
    assert (response.status_code, response.json()) == (
        503,
        {"detail": "node gpu-a is offline: its agent cannot answer"},
    )
    assert log_dispatcher.sent == []


def test_an_agents_error_is_a_bad_gateway(log_dispatcher: RecordingDispatcher, reader: APIClient) -> None:
    instance = placed_instance()
    log_dispatcher.failure = AgentFailed("node gpu-a could not give the log: no log for instance 1")
    response = reader.get(f"/api/v1/instances/{instance.pk}/log/")
    assert response.status_code == 502
    assert "no log for instance" in response.json()["detail"]


@pytest.mark.parametrize("lines", ["0", "-1", "ten", "10001", "1e3"])
def test_a_bad_line_count_names_the_parameter(
    log_dispatcher: RecordingDispatcher, reader: APIClient, lines: str
) -> None:
    instance = placed_instance()
    response = reader.get(f"/api/v1/instances/{instance.pk}/log/", {"lines": lines})
    assert response.status_code == 400
    assert "lines" in response.json()


def test_the_log_needs_a_token(
    log_dispatcher: RecordingDispatcher, client_for: Callable[[Role | None], APIClient]
) -> None:
    instance = placed_instance()
    assert client_for(None).get(f"/api/v1/instances/{instance.pk}/log/").status_code == 401
