"""Listing: pagination, filters and ordering; the schema and the Swagger page."""

from typing import Any

import pytest
from msgspec.structs import replace
from rest_framework.test import APIClient

from controlplane.accounts.models import Role
from controlplane.audit.records import Actor
from controlplane.deployments.evacuation import drain_node
from controlplane.deployments.pipelines import stop_pipeline
from controlplane.deployments.upkeep import place_pending_instances
from controlplane.fleet.actions import register_node
from tests.controlplane.factories import TEST_ACTOR, deploy, make_model, make_node, node_report, run_instance

pytestmark = pytest.mark.django_db


def names(response: Any, key: str = "name") -> list[Any]:
    assert response.status_code == 200, response.content
    return [row[key] for row in response.json()["results"]]


def test_lists_are_paginated_with_a_page_size_the_client_may_choose_up_to_500(reader: APIClient) -> None:
    for index in range(7):
        make_model(f"model-{index}")
    first = reader.get("/api/v1/models/?page_size=3").json()
    assert first["count"] == 7
    assert [row["name"] for row in first["results"]] == ["model-0", "model-1", "model-2"]
    assert first["next"].endswith("page=2&page_size=3")
    assert names(reader.get("/api/v1/models/?page_size=3&page=3")) == ["model-6"]
    assert reader.get("/api/v1/models/?page=9").status_code == 404
    assert reader.get("/api/v1/models/?page=abc").status_code == 404
    assert len(names(reader.get("/api/v1/models/?page_size=100000"))) == 7


def test_models_filter_by_engine_and_name(reader: APIClient) -> None:
    make_model("smol-mock")
    make_model("smol-gguf", source_kind="gguf", source="/m/smol.gguf", engine="llamacpp")
    make_model("big", source_kind="folder", source="/m/big", engine="vllm")
    assert names(reader.get("/api/v1/models/?engine=llamacpp")) == ["smol-gguf"]
    assert names(reader.get("/api/v1/models/?name_contains=SMOL")) == ["smol-gguf", "smol-mock"]
    assert names(reader.get("/api/v1/models/?source_kind=folder")) == ["big"]
    assert reader.get("/api/v1/models/?engine=gpt").status_code == 400


def test_nodes_filter_by_state_drain_and_label(reader: APIClient) -> None:
    register_node(Actor.agent("a"), "a", replace(node_report(), labels={"zone": "east"}))
    b = make_node("b", ())
    make_node("c", ())
    drain_node(TEST_ACTOR, b)
    assert names(reader.get("/api/v1/nodes/?draining=true")) == ["b"]
    assert names(reader.get("/api/v1/nodes/?label=zone=east")) == ["a"]
    assert names(reader.get("/api/v1/nodes/?label=zone=west")) == []
    assert names(reader.get("/api/v1/nodes/?label=zone")) == ["a"]
    assert names(reader.get("/api/v1/nodes/?state=online&ordering=-name")) == ["c", "b", "a"]
    assert reader.get("/api/v1/nodes/?state=sleeping").status_code == 400


def test_instances_filter_by_pipeline_node_state_and_placement(reader: APIClient) -> None:
    make_node("gpu-a", (80, 80))
    chat = deploy("chat", replicas=2, gpus_per_replica=1)
    place_pending_instances(TEST_ACTOR)
    deploy("other", replicas=1, gpus_per_replica=4)  # does not fit: stays unplaced
    place_pending_instances(TEST_ACTOR)
    run_instance(chat.instances.select_related("node", "pipeline", "group").get(replica=0))
    assert names(reader.get(f"/api/v1/instances/?pipeline={chat.pk}")) == ["chat-aggregated-0", "chat-aggregated-1"]
    assert names(reader.get("/api/v1/instances/?pipeline_name=other")) == ["other-aggregated-0"]
    assert names(reader.get("/api/v1/instances/?node=gpu-a&state=ready")) == ["chat-aggregated-0"]
    assert len(names(reader.get("/api/v1/instances/?state=ready&state=pending"))) == 3
    assert names(reader.get("/api/v1/instances/?placed=false")) == ["other-aggregated-0"]
    assert reader.get("/api/v1/instances/?state=sleeping").status_code == 400
    assert reader.get("/api/v1/instances/?pipeline=abc").status_code == 400
    ready = reader.get("/api/v1/instances/?state=ready").json()["results"][0]
    assert (ready["endpoint_instance_id"], ready["pid"], ready["role"]) == ("abc", 4242, "aggregated")


def test_unplaced_instances_show_why(reader: APIClient) -> None:
    make_node("gpu-a", (16,))
    deploy("big", make_model("big", memory_bytes=40 << 30), gpus_per_replica=1)
    place_pending_instances(TEST_ACTOR)
    [row] = reader.get("/api/v1/instances/").json()["results"]
    assert row["node"] is None
    assert row["reason"].startswith("needs 1 GPU with 40 GiB free; the best node, gpu-a, has 0")


def test_pipelines_filter_and_show_instance_counts(reader: APIClient) -> None:
    deploy("chat", replicas=2, router_mode="kv")
    stop_pipeline(TEST_ACTOR, deploy("old"))
    assert names(reader.get("/api/v1/pipelines/?state=stopped")) == ["old"]
    [chat] = reader.get("/api/v1/pipelines/?router_mode=kv").json()["results"]
    assert chat["groups"][0]["instances"] == {"pending": 2}
    assert names(reader.get("/api/v1/pipelines/?model=chat-model")) == ["chat"]


def test_the_audit_log_filters_by_action_target_and_time(operator: APIClient) -> None:
    pipeline = deploy("chat")
    stop_pipeline(TEST_ACTOR, pipeline)
    assert names(operator.get("/api/v1/audit/?action=pipeline.stop"), "target_name") == ["chat"]
    by_prefix = names(operator.get("/api/v1/audit/?action_prefix=pipeline."), "action")
    assert by_prefix == ["pipeline.stop", "pipeline.deploy"]
    by_target = names(operator.get(f"/api/v1/audit/?target_type=pipeline&target_id={pipeline.pk}"), "action")
    assert by_target == ["pipeline.stop", "pipeline.deploy"]
    assert names(operator.get("/api/v1/audit/?since=2999-01-01T00:00:00Z")) == []
    assert operator.get("/api/v1/audit/?since=yesterday").status_code == 400


def test_the_api_writes_the_acting_persons_name_into_the_audit_log(client_for: Any) -> None:
    operator = client_for(Role.OPERATOR)
    make_model("smol")
    response = operator.post("/api/v1/pipelines/", {"name": "chat", "model": "smol", "groups": [{}]}, format="json")
    assert response.status_code == 201
    entries = operator.get("/api/v1/audit/?action=pipeline.deploy").json()["results"]
    assert entries[0]["actor_name"].startswith("operator-")


def test_the_schema_renders_and_describes_every_resource(client: Any) -> None:
    response = client.get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    schema = response.json()
    for path in ("/api/v1/models/", "/api/v1/pipelines/{id}/scale/", "/api/v1/agent/heartbeat/", "/api/v1/audit/"):
        assert path in schema["paths"], path
    assert schema["components"]["securitySchemes"]["tokenAuth"]["scheme"] == "bearer"


def test_the_swagger_page_renders_with_local_assets(client: Any) -> None:
    response = client.get("/api/v1/docs/")
    assert response.status_code == 200
    page = response.content.decode()
    assert "swagger-ui" in page
    assert "/static/drf_spectacular_sidecar/swagger-ui-dist/" in page
    assert "cdn.jsdelivr" not in page
