"""A node's machine identity: two machines given one node name do not share its queue silently."""

from collections.abc import Callable

import pytest
from rest_framework.test import APIClient

from controlplane.audit.models import AuditEntry
from controlplane.deployments import evacuation
from controlplane.fleet import actions as fleet_actions
from controlplane.fleet.models import Node
from runtime.fleet_contract.reports import NodeReport
from tests.controlplane.factories import TEST_ACTOR

pytestmark = pytest.mark.django_db

REFUSAL = (
    "node gpu-a is registered by machine m1; this is machine m2: give this agent another --name, "
    "or delete the node first"
)


def register(agent: APIClient, machine_id: str | None) -> tuple[int, dict[str, object]]:
    body: dict[str, object] = {"name": "gpu-a", "cpu_count": 8}
    if machine_id is not None:
        body["machine_id"] = machine_id
    response = agent.post("/api/v1/agent/register/", body, format="json")
    return response.status_code, response.json()


def test_a_second_machine_registering_a_node_name_is_refused_with_409_and_audited(
    agent_client: Callable[[str], APIClient],
) -> None:
    agent = agent_client("gpu-a")
    assert register(agent, "m1")[0] == 200
    status, body = register(agent, "m2")
    assert (status, body) == (409, {"detail": REFUSAL})
    assert Node.objects.get(name="gpu-a").machine_id == "m1"
    entry = AuditEntry.objects.get(action="node.machine_refused")
    assert (entry.actor_name, entry.target_name, entry.before) == ("agent:gpu-a", "gpu-a", {"machine_id": "m1"})
    assert entry.after == {"machine_id": "m2", "refused": REFUSAL}
    assert register(agent, "m1")[0] == 200  # the machine that has the name keeps it


def test_a_heartbeat_from_another_machine_is_refused_with_409_and_audited(
    agent_client: Callable[[str], APIClient],
) -> None:
    agent = agent_client("gpu-a")
    register(agent, "m1")
    response = agent.post("/api/v1/agent/heartbeat/", {"cpu_count": 8, "machine_id": "m2"}, format="json")
    assert (response.status_code, response.json()) == (409, {"detail": REFUSAL})
    assert AuditEntry.objects.filter(action="node.machine_refused").count() == 1
    response = agent.post("/api/v1/agent/heartbeat/", {"cpu_count": 8, "machine_id": "m1"}, format="json")
    assert response.status_code == 200


def test_a_node_registered_before_machine_ids_adopts_the_first_it_is_sent(
    agent_client: Callable[[str], APIClient],
) -> None:
    agent = agent_client("gpu-a")
    assert register(agent, None)[0] == 200
    assert Node.objects.get(name="gpu-a").machine_id == ""
    response = agent.post("/api/v1/agent/heartbeat/", {"cpu_count": 8, "machine_id": "m1"}, format="json")
    assert response.status_code == 200
    assert Node.objects.get(name="gpu-a").machine_id == "m1"
    assert AuditEntry.objects.filter(action="node.heartbeat", after__machine_id="m1").exists()
    assert register(agent, "m2")[0] == 409


def test_a_report_that_names_no_machine_is_not_checked() -> None:
    fleet_actions.register_node(TEST_ACTOR, "gpu-a", NodeReport(machine_id="m1"))
    node = fleet_actions.heartbeat(TEST_ACTOR, "gpu-a", NodeReport(cpu_count=4))
    assert (node.machine_id, node.cpu_count) == ("m1", 4)


def test_a_deleted_node_can_be_registered_by_another_machine(agent_client: Callable[[str], APIClient]) -> None:
    agent = agent_client("gpu-a")
    register(agent, "m1")
    evacuation.delete_node(TEST_ACTOR, Node.objects.get(name="gpu-a"))
    assert register(agent, "m2")[0] == 200
    assert Node.objects.get(name="gpu-a").machine_id == "m2"


def test_a_machine_id_that_is_not_a_plain_word_is_a_400(agent_client: Callable[[str], APIClient]) -> None:
    status, body = register(agent_client("gpu-a"), "m1; rm -rf /")
    assert status == 400 and "machine_id" in body
