"""An agent's conversation with the control plane over HTTP, and the people's actions it answers to."""

from collections.abc import Callable
from typing import Any

import pytest
from rest_framework.test import APIClient

from controlplane.audit.models import AuditEntry
from controlplane.deployments.upkeep import place_pending_instances
from controlplane.fleet.models import Node
from tests.controlplane.factories import TEST_ACTOR, make_model

pytestmark = pytest.mark.django_db

INVENTORY: dict[str, Any] = {
    "address": "10.0.0.5",
    "labels": {"zone": "east"},
    "cpu_count": 32,
    "memory_total_bytes": 256 << 30,
    "memory_available_bytes": 200 << 30,
    "agent_version": "0.1.0",
    "gpus": [
        {
            "index": 0,
            "name": "NVIDIA H100",
            "uuid": "GPU-5d2b7f3e-0c4a-11ee-be56-0242ac120002",
            "memory_total_bytes": 80 << 30,
            "memory_used_bytes": 1 << 30,
        },
        {"index": 1, "name": "NVIDIA H100", "uuid": "MIG-GPU-8f1c/1/0", "memory_total_bytes": 80 << 30},
    ],
}


def test_an_agent_registers_heartbeats_runs_an_instance_and_reports_it(
    agent_client: Callable[[str], APIClient], operator: APIClient
) -> None:
    agent = agent_client("gpu-a")
    response = agent.post("/api/v1/agent/register/", {"name": "gpu-a", **INVENTORY}, format="json")
    assert response.status_code == 200
    node = response.json()
    assert (node["state"], node["labels"], len(node["gpus"])) == ("online", {"zone": "east"}, 2)

    busy = INVENTORY | {"gpus": [gpu | {"utilization_percent": 90} for gpu in INVENTORY["gpus"]]}
    response = agent.post("/api/v1/agent/heartbeat/", busy, format="json")
    assert response.json() == {"name": "gpu-a", "state": "online", "draining": False}
    assert Node.objects.get().gpus.get(index=1).utilization_percent == 90
    assert Node.objects.get().gpus.get(index=1).uuid == "MIG-GPU-8f1c/1/0"

    make_model("smol", default_engine_args={"speedup_ratio": 10, "dp_size": 1}, memory_bytes=8 << 30)
    deployed = operator.post(
        "/api/v1/pipelines/",
        {
            "name": "org/smol-chat",
            "model": "smol",
            "router": {"mode": "kv", "temperature": 0.5, "kv_queued_prefill_weight": 0.25, "disagg_policy": "isl"},
            "groups": [{"replicas": 1, "gpus_per_replica": 1, "engine_args": {"dp_size": 2}}],
        },
        format="json",
    ).json()
    place_pending_instances(TEST_ACTOR)

    [spec] = agent.get("/api/v1/agent/instances/").json()
    assert spec["endpoint"] == "dyn://org-smol-chat.backend.generate"
    assert spec["served_model_name"] == "org/smol-chat"
    assert spec["gpu_indexes"] == [1]  # the emptier GPU
    assert spec["engine_args"] == {"speedup_ratio": 10, "dp_size": 2}  # the group's args over the model's
    assert deployed["router"]["kv_queued_prefill_weight"] == 0.25
    assert spec["router"] == {
        "mode": "kv",
        "kv_overlap_score_weight": 1.0,
        "kv_queued_prefill_weight": 0.25,
        "temperature": 0.5,
        "use_kv_events": True,
        "disagg_policy": "isl",
        "disagg_isl_threshold": 2048,
        "disagg_isl_ratio": 0.7,
        "disagg_prefill_busy": 1.0,
        "disagg_decode_busy": None,
        "kv_host_hit_weight": 0.75,
        "kv_disk_hit_weight": 0.25,
    }
    assert spec["model"]["source"] == "HuggingFaceTB/SmolLM2-135M-Instruct"

    state_path = f"/api/v1/agent/instances/{spec['id']}/state/"
    for body in (
        {"state": "downloading", "download_progress": 0.5},
        {"state": "starting", "pid": 1234},
        {"state": "ready", "endpoint_instance_id": 0x7FFF_FFFF_FFFF_FFFF},
    ):
        assert agent.post(state_path, body, format="json").status_code == 200, body
    instance = operator.get(f"/api/v1/instances/{spec['id']}/").json()
    assert (instance["state"], instance["pid"], instance["endpoint_instance_id"]) == ("ready", 1234, "7fffffffffffffff")
    pipeline = operator.get(f"/api/v1/pipelines/{deployed['id']}/").json()
    assert pipeline["groups"][0]["instances"] == {"ready": 1}

    response = agent.post("/api/v1/agent/downloads/", {"model": spec["model"]["id"], "state": "done"}, format="json")
    assert response.json()["state"] == "done"
    assert operator.get("/api/v1/downloads/?node=gpu-a").json()["count"] == 1

    actors = set(AuditEntry.objects.values_list("actor_name", flat=True))
    assert {"agent:gpu-a", "system:tests"} <= actors


def test_people_restart_scale_and_drain_through_the_api(
    agent_client: Callable[[str], APIClient], operator: APIClient
) -> None:
    agent = agent_client("gpu-a")
    agent.post("/api/v1/agent/register/", {"name": "gpu-a", **INVENTORY}, format="json")
    make_model("smol")
    pipeline = operator.post(
        "/api/v1/pipelines/", {"name": "chat", "model": "smol", "groups": [{"replicas": 1}]}, format="json"
    ).json()
    place_pending_instances(TEST_ACTOR)
    [spec] = agent.get("/api/v1/agent/instances/").json()
    agent.post(f"/api/v1/agent/instances/{spec['id']}/state/", {"state": "ready"}, format="json")

    scaled = operator.post(f"/api/v1/pipelines/{pipeline['id']}/scale/", {"replicas": 2}, format="json").json()
    assert scaled["groups"][0]["replicas"] == 2
    assert scaled["groups"][0]["instances"] == {"ready": 1, "pending": 1}

    # One of two replicas restarts in place: the other serves meanwhile.
    restarted = operator.post(f"/api/v1/instances/{spec['id']}/restart/").json()
    assert (restarted["state"], restarted["restart_requested"]) == ("stopping", True)
    spec = next(row for row in agent.get("/api/v1/agent/instances/").json() if row["id"] == spec["id"])
    assert (spec["state"], spec["restart_requested"]) == ("stopping", True)
    agent.post(f"/api/v1/agent/instances/{spec['id']}/state/", {"state": "stopped"}, format="json")
    again = operator.get(f"/api/v1/instances/{spec['id']}/").json()
    assert (again["state"], again["restarts"], again["node"]) == ("pending", 1, "gpu-a")

    node = Node.objects.get()
    refused = operator.post(f"/api/v1/nodes/{node.pk}/drain/")  # the only node: the pipeline would stop
    assert refused.status_code == 409 and "draining gpu-a would stop pipeline chat" in refused.json()["detail"]
    assert operator.post(f"/api/v1/nodes/{node.pk}/drain/", {"force": "maybe"}, format="json").status_code == 400
    drained = operator.post(f"/api/v1/nodes/{node.pk}/drain/", {"force": True}, format="json").json()
    assert (drained["draining"], drained["schedulable"]) == (True, False)
    assert agent.post("/api/v1/agent/heartbeat/", INVENTORY, format="json").json()["draining"] is True


def two_replicas_placed_on_gpu_a(agent_client: Callable[[str], APIClient], operator: APIClient) -> APIClient:
    """Node gpu-a registered, pipeline chat's two replicas placed on it; gpu-a's agent client."""
    agent = agent_client("gpu-a")
    agent.post("/api/v1/agent/register/", {"name": "gpu-a", **INVENTORY}, format="json")
    make_model("smol")
    operator.post("/api/v1/pipelines/", {"name": "chat", "model": "smol", "groups": [{"replicas": 2}]}, format="json")
    place_pending_instances(TEST_ACTOR)
    return agent


def test_a_report_about_an_older_attempt_is_answered_409_and_a_permanent_failure_gives_up(
    agent_client: Callable[[str], APIClient], operator: APIClient
) -> None:
    agent = two_replicas_placed_on_gpu_a(agent_client, operator)
    spec = agent.get("/api/v1/agent/instances/").json()[0]
    state_path = f"/api/v1/agent/instances/{spec['id']}/state/"
    assert agent.post(state_path, {"state": "ready", "attempt": 0}, format="json").status_code == 200
    operator.post(f"/api/v1/instances/{spec['id']}/restart/")
    agent.post(state_path, {"state": "stopped", "attempt": 0}, format="json")  # attempt 1 is pending now

    late = agent.post(state_path, {"state": "starting", "attempt": 0}, format="json")

    assert late.status_code == 409
    assert "about attempt 0 of instance chat-aggregated-0, which is at attempt 1 now" in late.json()["detail"]
    body = {"state": "failed", "reason": "exit code 2: unknown flag", "attempt": 1, "permanent": True}
    assert agent.post(state_path, body, format="json").status_code == 200
    failed = operator.get(f"/api/v1/instances/{spec['id']}/").json()
    assert (failed["state"], failed["node"], failed["gpu_indexes"]) == ("failed", None, [])
    assert failed["reason"] == "gave up on node gpu-a, as retrying cannot fix it: exit code 2: unknown flag"


def test_a_report_about_another_incarnation_of_the_id_is_answered_409(
    agent_client: Callable[[str], APIClient], operator: APIClient
) -> None:
    """A worker of an instance a restored database no longer has, whose id a new instance got."""
    agent = two_replicas_placed_on_gpu_a(agent_client, operator)
    first, second = agent.get("/api/v1/agent/instances/").json()
    assert len(first["incarnation"]) == 32 and first["incarnation"] != second["incarnation"]  # random, per row
    state_path = f"/api/v1/agent/instances/{first['id']}/state/"

    stale = {"state": "ready", "attempt": 0, "incarnation": second["incarnation"]}
    refused = agent.post(state_path, stale, format="json")
    assert refused.status_code == 409
    assert f"about incarnation {second['incarnation']} of instance id {first['id']}" in refused.json()["detail"]
    assert operator.get(f"/api/v1/instances/{first['id']}/").json()["state"] == "pending"  # nothing adopted

    assert agent.post(state_path, {**stale, "incarnation": "not hex"}, format="json").status_code == 400
    own = {"state": "ready", "attempt": 0, "incarnation": first["incarnation"]}
    assert agent.post(state_path, own, format="json").status_code == 200
