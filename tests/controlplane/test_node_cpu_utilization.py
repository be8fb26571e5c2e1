"""A node's CPU utilisation, as its agent's heartbeats report it: stored on the node, shown in the API and on the
Nodes page, not said by older agents, and not believed outside 0..100 (the heartbeat is still taken)."""

import logging
from collections.abc import Callable
from typing import Any

import pytest
from rest_framework.test import APIClient

from controlplane.audit.models import AuditEntry
from controlplane.dashboard import partials
from controlplane.fleet import actions as fleet_actions
from controlplane.fleet.models import Node
from runtime.rate_limited_log import RateLimitedLog

pytestmark = pytest.mark.django_db

INVENTORY: dict[str, Any] = {
    "cpu_count": 16,
    "memory_total_bytes": 64 << 30,
    "memory_available_bytes": 60 << 30,
    "gpus": [{"index": 0, "name": "NVIDIA L4", "memory_total_bytes": 24 << 30}],
}


@pytest.fixture
def agent(agent_client: Callable[[str], APIClient]) -> APIClient:
    """Node gpu-a's agent, registered (with no CPU figure yet, as an agent's first report has none)."""
    client = agent_client("gpu-a")
    assert client.post("/api/v1/agent/register/", {"name": "gpu-a", **INVENTORY}, format="json").status_code == 200
    return client


@pytest.fixture
def warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh rate limit for the implausible-figure warning, so that each test sees its first line."""
    monkeypatch.setattr(fleet_actions, "_implausible_figures", RateLimitedLog(fleet_actions.log, period_s=60.0))


def heartbeat(agent: APIClient, **figures: object) -> None:
    response = agent.post("/api/v1/agent/heartbeat/", INVENTORY | figures, format="json")
    assert response.status_code == 200, response.content


def test_a_heartbeat_s_cpu_utilisation_is_stored_and_shown_by_the_api(agent: APIClient, reader: APIClient) -> None:
    assert Node.objects.get().cpu_utilization_percent is None
    heartbeat(agent, cpu_utilization_percent=37.5)
    assert Node.objects.get().cpu_utilization_percent == 37.5
    [node] = reader.get("/api/v1/nodes/").json()["results"]
    assert node["cpu_utilization_percent"] == 37.5
    heartbeat(agent, cpu_utilization_percent=0)
    assert Node.objects.get().cpu_utilization_percent == 0.0
    # A usage figure, like memory available: not audited, and not in the node's audit entries.
    assert AuditEntry.objects.filter(action="node.heartbeat").count() == 0
    assert "cpu_utilization_percent" not in AuditEntry.objects.get(action="node.register").after


def test_an_agent_that_does_not_say_leaves_the_node_without_a_figure(agent: APIClient) -> None:
    heartbeat(agent, cpu_utilization_percent=55)
    heartbeat(agent)  # an older agent, or one whose machine has no /proc/stat
    assert Node.objects.get().cpu_utilization_percent is None


@pytest.mark.parametrize("figure", [100.5, -0.1, 1e300])
@pytest.mark.usefixtures("warnings")
def test_a_figure_outside_0_to_100_is_logged_and_recorded_as_not_known_and_the_heartbeat_taken(
    agent: APIClient, figure: float, caplog: pytest.LogCaptureFixture
) -> None:
    heartbeat(agent, cpu_utilization_percent=55)
    with caplog.at_level(logging.WARNING, logger="controlplane.fleet.actions"):
        heartbeat(agent, cpu_utilization_percent=figure, memory_available_bytes=10 << 30)
    node = Node.objects.get()
    assert node.cpu_utilization_percent is None  # not the figure, nor the last good one
    assert node.memory_available_bytes == 10 << 30 and node.state == Node.State.ONLINE
    [said] = [record.getMessage() for record in caplog.records]
    assert "node gpu-a" in said and f"{figure:g}%" in said and "outside 0..100" in said


def test_a_figure_that_is_not_a_number_is_a_400_naming_the_field(agent: APIClient) -> None:
    response = agent.post("/api/v1/agent/heartbeat/", INVENTORY | {"cpu_utilization_percent": "busy"}, format="json")
    assert response.status_code == 400 and "cpu_utilization_percent" in response.content.decode()


def test_the_nodes_page_shows_the_figure_beside_the_cpus_once_there_is_one(agent: APIClient) -> None:
    node = Node.objects.get()
    assert "busy" not in partials.render_node(node.pk, can_act=False)
    heartbeat(agent, cpu_utilization_percent=37.6)
    html = partials.render_node(node.pk, can_act=False)
    assert 'max="100" high="90" value="37.6"' in html and "38%" in html
