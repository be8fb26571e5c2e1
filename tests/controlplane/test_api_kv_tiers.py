"""KV cache tiers through the REST API: the router's hit weights and the host tier per replica, deployed,
read back, changed and refused with the field named."""

from typing import Any

import pytest
from rest_framework.test import APIClient

from controlplane.deployments.models import Pipeline
from tests.controlplane.factories import make_model

pytestmark = pytest.mark.django_db

MOCKER_ARGS = {"kv_bytes_per_token": 23040, "block_size": 16}


def body(**change: Any) -> dict[str, Any]:
    return {"name": "chat", "model": "smol", "groups": [{"replicas": 1, "engine_args": MOCKER_ARGS}]} | change


def deployed(operator: APIClient, **change: Any) -> dict[str, Any]:
    make_model("smol")
    response = operator.post("/api/v1/pipelines/", body(**change), format="json")
    assert response.status_code == 201, response.content
    result: dict[str, Any] = response.json()
    return result


def test_a_pipeline_deployed_with_hit_weights_and_a_host_tier_reads_them_back(operator: APIClient) -> None:
    sent = deployed(operator, router={"mode": "kv", "kv_host_hit_weight": 0.5, "kv_disk_hit_weight": 0.1},
                    kv_host_cache_gib=8)  # fmt: skip
    read = operator.get(f"/api/v1/pipelines/{sent['id']}/").json()
    assert (read["router"]["kv_host_hit_weight"], read["router"]["kv_disk_hit_weight"]) == (0.5, 0.1)
    assert read["kv_host_cache_gib"] == 8.0
    pipeline = Pipeline.objects.get()
    assert (pipeline.kv_host_hit_weight, pipeline.kv_disk_hit_weight, pipeline.kv_host_cache_gib) == (0.5, 0.1, 8.0)


def test_a_pipeline_deployed_without_them_gets_dynamos_weights_and_no_host_tier(operator: APIClient) -> None:
    read = deployed(operator)
    assert (read["router"]["kv_host_hit_weight"], read["router"]["kv_disk_hit_weight"]) == (0.75, 0.25)
    assert read["kv_host_cache_gib"] == 0.0


def test_a_null_host_tier_means_none(operator: APIClient) -> None:
    assert deployed(operator, kv_host_cache_gib=None)["kv_host_cache_gib"] == 0.0


def test_changing_the_host_tier_restarts_the_workers_but_leaves_the_router_generation(operator: APIClient) -> None:
    sent = deployed(operator)
    response = operator.patch(f"/api/v1/pipelines/{sent['id']}/", {"kv_host_cache_gib": 4}, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["kv_host_cache_gib"] == 4.0
    pipeline = Pipeline.objects.get()
    assert (pipeline.router_generation, pipeline.groups.get().generation) == (1, 2)


def test_changing_a_hit_weight_rolls_out_as_a_router_setting(operator: APIClient) -> None:
    sent = deployed(operator)
    response = operator.patch(
        f"/api/v1/pipelines/{sent['id']}/", {"router": {"kv_host_hit_weight": 0.9}}, format="json"
    )
    assert response.status_code == 200, response.content
    pipeline = Pipeline.objects.get()
    assert (pipeline.kv_host_hit_weight, pipeline.router_generation, pipeline.groups.get().generation) == (0.9, 2, 2)


def test_the_schema_documents_the_weights_and_the_host_tier(operator: APIClient) -> None:
    schema = operator.get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    router = schema["components"]["schemas"]["Router"]["properties"]
    assert router["kv_host_hit_weight"]["maximum"] == 1 and router["kv_disk_hit_weight"]["default"] == 0.25
    host = schema["components"]["schemas"]["Pipeline"]["properties"]["kv_host_cache_gib"]
    assert (host["minimum"], host["maximum"], host["nullable"]) == (0, 4096, True)
    assert "kv_host_cache_gib" in schema["components"]["schemas"]["PatchedPipelineUpdateRequest"]["properties"]


@pytest.mark.parametrize(
    ("change", "path", "message"),
    [
        ({"router": {"kv_host_hit_weight": 1.5}}, ["router", "kv_host_hit_weight"], "less than or equal to 1"),
        ({"router": {"kv_host_hit_weight": -0.1}}, ["router", "kv_host_hit_weight"], "greater than or equal to 0"),
        ({"router": {"kv_disk_hit_weight": "lots"}}, ["router", "kv_disk_hit_weight"], "A valid number"),
        ({"router": {"kv_disk_hit_weight": None}}, ["router", "kv_disk_hit_weight"], "may not be null"),
        ({"kv_host_cache_gib": -1}, ["kv_host_cache_gib"], "greater than or equal to 0"),
        ({"kv_host_cache_gib": 5000}, ["kv_host_cache_gib"], "less than or equal to 4096"),
        ({"kv_host_cache_gib": "8 GiB"}, ["kv_host_cache_gib"], "A valid number"),
        ({"kv_host_cache_gib": [8]}, ["kv_host_cache_gib"], "A valid number"),
    ],
)
def test_bad_weights_and_tier_sizes_are_400s_naming_the_field(
    operator: APIClient, change: dict[str, Any], path: list[str], message: str
) -> None:
    make_model("smol")
    response = operator.post("/api/v1/pipelines/", body(**change), format="json")
    assert response.status_code == 400, response.content
    errors: Any = response.json()
    for step in path:
        errors = errors[step]
    assert message in errors[0]


def test_a_mocker_host_tier_without_kv_bytes_per_token_is_a_400_naming_the_key(operator: APIClient) -> None:
    make_model("smol")
    sent = body(kv_host_cache_gib=8, groups=[{"replicas": 1}])
    response = operator.post("/api/v1/pipelines/", sent, format="json")
    assert response.status_code == 400
    (message,) = response.json()["kv_host_cache_gib"]
    assert message.startswith("the aggregated group: the mocker counts its host tier in blocks: its engine args need "
                              "'kv_bytes_per_token'")  # fmt: skip


def test_a_host_tier_for_an_engine_without_one_is_a_400_naming_the_setting(operator: APIClient) -> None:
    make_model("smol")
    sent = body(kv_host_cache_gib=8, groups=[{"replicas": 1, "engine": "echo_core"}])
    response = operator.post("/api/v1/pipelines/", sent, format="json")
    assert response.status_code == 400
    assert response.json()["kv_host_cache_gib"][0].startswith(
        "the aggregated group: echo_core keeps no KV cache tier in host memory"
    )


def test_a_host_tier_added_later_is_checked_against_the_groups_engine_args(operator: APIClient) -> None:
    make_model("smol")
    sent = operator.post("/api/v1/pipelines/", body(groups=[{"replicas": 1}]), format="json").json()
    response = operator.patch(f"/api/v1/pipelines/{sent['id']}/", {"kv_host_cache_gib": 8}, format="json")
    assert response.status_code == 400 and "'kv_bytes_per_token'" in response.json()["kv_host_cache_gib"][0]
    assert Pipeline.objects.get().kv_host_cache_gib == 0.0


def test_group_engine_args_that_would_leave_the_tier_unsized_are_a_400_on_engine_args(operator: APIClient) -> None:
    sent = deployed(operator, kv_host_cache_gib=8)
    response = operator.post(
        f"/api/v1/pipelines/{sent['id']}/update-group/", {"engine_args": {"block_size": 16}}, format="json"
    )
    assert response.status_code == 400 and "'kv_bytes_per_token'" in response.json()["engine_args"][0]
