"""Bad input to every endpoint: a 4xx naming the field, never a 500 (the test client raises on a 500)."""

import json
from typing import Any

import pytest
from rest_framework.test import APIClient

from controlplane.catalog.api.views import ModelViewSet
from controlplane.catalog.models import LanguageModel
from controlplane.deployments.models import Instance
from controlplane.deployments.upkeep import place_pending_instances
from tests.controlplane.factories import TEST_ACTOR, agent_token, deploy, make_model, make_node

pytestmark = pytest.mark.django_db

GOOD_MODEL = {"name": "smol", "source_kind": "hf", "source": "org/smol", "engine": "mocker"}
# Values of the wrong type for any field.
GARBAGE: list[Any] = [None, True, -1, 2**80, 1.5, "", "x" * 5000, [], [1, [2]], {}, {"a": {"b": 1}}]


def agent(node: str = "gpu-a") -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {agent_token(node)}")
    return client


def errors(response: Any) -> dict[str, Any]:
    assert response.status_code == 400, (response.status_code, response.content)
    body: dict[str, Any] = response.json()
    return body


def post_raw(client: APIClient, path: str, body: bytes, content_type: str = "application/json") -> Any:
    return client.generic("POST", path, body, content_type=content_type)


# Models


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"name": "has space"}, "name"),
        ({"name": ["smol"]}, "name"),
        ({"source_kind": "zip"}, "source_kind"),
        ({"engine": "gpt"}, "engine"),
        ({"source": "not/a/repo/id"}, "source"),
        ({"engine": "llamacpp"}, "engine"),
        ({"default_engine_args": "max_tokens=1"}, "default_engine_args"),
        ({"default_engine_args": [1, 2]}, "default_engine_args"),
        ({"default_engine_args": {"a": "nul\x00"}}, "default_engine_args"),
        ({"default_engine_args": {"a": "x" * 20000}}, "default_engine_args"),
        ({"size_bytes": -1}, "size_bytes"),
        ({"size_bytes": "lots"}, "size_bytes"),
        ({"memory_bytes": 2**70}, "memory_bytes"),
        ({"memory_bytes": 1.5}, "memory_bytes"),
        ({"projector": "mmproj.gguf"}, "projector"),  # the good model is the mocker's: no projector
        ({"projector": ["mmproj.gguf"]}, "projector"),
        ({"projector": "x" * 1025}, "projector"),
    ],
)
def test_bad_model_fields_are_named(operator: APIClient, change: dict[str, Any], field: str) -> None:
    body = errors(operator.post("/api/v1/models/", GOOD_MODEL | change, format="json"))
    assert field in body


def test_a_llamacpp_model_takes_a_projector_of_its_repo_and_shows_it(operator: APIClient) -> None:
    body = GOOD_MODEL | {"engine": "llamacpp", "filename": "model.Q4_0.gguf", "projector": "mmproj-model-f16.gguf"}
    created = operator.post("/api/v1/models/", body, format="json")
    assert created.status_code == 201, created.content
    assert operator.get(f"/api/v1/models/{created.json()['id']}/").json()["projector"] == "mmproj-model-f16.gguf"


def test_a_model_without_its_required_fields_names_each(operator: APIClient) -> None:
    body = errors(operator.post("/api/v1/models/", {}, format="json"))
    assert set(body) == {"name", "source_kind", "source", "engine"}


def test_deeply_nested_engine_args_are_refused(operator: APIClient) -> None:
    nested: Any = "leaf"
    for _ in range(20):
        nested = {"a": nested}
    body = errors(operator.post("/api/v1/models/", GOOD_MODEL | {"default_engine_args": nested}, format="json"))
    assert "nested more than 8 levels" in body["default_engine_args"][0]


def test_a_model_name_taken_is_a_400_naming_it(operator: APIClient) -> None:
    make_model("smol")
    assert "name" in errors(operator.post("/api/v1/models/", GOOD_MODEL, format="json"))


def test_patching_a_model_checks_the_merged_result(operator: APIClient) -> None:
    model = make_model("smol")
    body = errors(operator.patch(f"/api/v1/models/{model.pk}/", {"engine": "llamacpp"}, format="json"))
    assert body["engine"][0].startswith("llamacpp loads GGUF files")


@pytest.mark.parametrize("path", ["/api/v1/models/abc/", "/api/v1/models/99999999999999999999/", "/api/v1/models/7/"])
def test_unknown_or_malformed_ids_are_404(operator: APIClient, path: str) -> None:
    assert operator.get(path).status_code == 404
    assert operator.patch(path, {}, format="json").status_code == 404


def test_a_model_deleted_between_the_lookup_and_its_change_is_a_404(
    operator: APIClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PATCH racing a DELETE (issue 39: a 500 under API automation): the change reads its row again under
    a lock, and finds it gone."""
    model = make_model("doomed")
    lookup = ModelViewSet.get_object

    def lookup_then_lose_it(view: ModelViewSet) -> LanguageModel:
        found = lookup(view)
        LanguageModel.objects.filter(pk=found.pk).delete()  # the other request's DELETE commits here
        return found

    monkeypatch.setattr(ModelViewSet, "get_object", lookup_then_lose_it)
    response = operator.patch(f"/api/v1/models/{model.pk}/", {"default_engine_args": {}}, format="json")
    assert response.status_code == 404
    assert "deleted meanwhile" in response.json()["detail"]


# Bodies that are not JSON objects, anywhere


@pytest.mark.parametrize(
    ("body", "content_type", "status"),
    [
        (b"{not json", "application/json", 400),
        (b'{"name": NaN}', "application/json", 400),
        (b'{"size_bytes": 1e400}', "application/json", 400),
        (b"[" * 100_000 + b"]" * 100_000, "application/json", 400),
        (b"\xff\xfe garbage", "application/json", 400),
        (b"{}", "application/json; charset=bz2_codec", 400),
        (b"{}", "application/json; charset=no-such-charset", 400),
        (b"name=smol", "application/x-www-form-urlencoded", 415),
        (json.dumps({"pad": "x" * (2 << 20)}).encode(), "application/json", 413),
        (b"[]", "application/json", 400),
        (b'"text"', "application/json", 400),
    ],
)
def test_bodies_that_are_not_a_json_object_are_refused(
    operator: APIClient, body: bytes, content_type: str, status: int
) -> None:
    response = post_raw(operator, "/api/v1/models/", body, content_type)
    assert response.status_code == status, response.content


def test_json_nested_past_the_parsers_recursion_is_a_400(operator: APIClient) -> None:
    response = post_raw(operator, "/api/v1/models/", b"[" * 100_000 + b"]" * 100_000)
    assert response.json()["detail"] == "JSON parse error: nested too deeply"


def test_a_huge_body_is_refused_with_the_limit_named(operator: APIClient) -> None:
    response = post_raw(operator, "/api/v1/pipelines/", b" " * (2 << 20))
    assert response.status_code == 413
    assert "over the limit of 1048576 bytes" in response.json()["detail"]


# Pipelines


def pipeline_body(**change: Any) -> dict[str, Any]:
    return {"name": "chat", "model": "smol", "groups": [{"replicas": 1}]} | change


@pytest.mark.parametrize(
    ("change", "path"),
    [
        ({"model": "ghost"}, ["model"]),
        ({"model": 5}, ["model"]),
        ({"name": "bad name"}, ["name"]),
        ({"name": "x" * 300}, ["name"]),
        ({"namespace": "a.b"}, ["namespace"]),
        ({"groups": []}, ["groups"]),
        ({"groups": "one"}, ["groups"]),
        ({"groups": [{}, {}, {}]}, ["groups"]),
        ({"groups": [{"replicas": -1}]}, ["groups", "0", "replicas"]),
        ({"groups": [{"replicas": "many"}]}, ["groups", "0", "replicas"]),
        ({"groups": [{"replicas": 100_000}]}, ["groups", "0", "replicas"]),
        ({"groups": [{"gpus_per_replica": 99}]}, ["groups", "0", "gpus_per_replica"]),
        ({"groups": [{"engine": "gpt"}]}, ["groups", "0", "engine"]),
        ({"groups": [{"role": "boss"}]}, ["groups", "0", "role"]),
        ({"groups": [{"engine_args": [1]}]}, ["groups", "0", "engine_args"]),
        ({"groups": [{"engine": "vllm"}]}, ["groups"]),
        ({"groups": [{"role": "prefill"}]}, ["groups"]),
        ({"router": {"mode": "smart"}}, ["router", "mode"]),
        ({"router": {"temperature": -0.1}}, ["router", "temperature"]),
        ({"router": {"kv_overlap_score_weight": "heavy"}}, ["router", "kv_overlap_score_weight"]),
        ({"router": {"kv_queued_prefill_weight": 1.5}}, ["router", "kv_queued_prefill_weight"]),
        ({"router": {"kv_queued_prefill_weight": "x"}}, ["router", "kv_queued_prefill_weight"]),
        ({"router": {"use_kv_events": "perhaps"}}, ["router", "use_kv_events"]),
        ({"router": {"disagg_policy": "sometimes"}}, ["router", "disagg_policy"]),
        ({"router": {"disagg_isl_threshold": -1}}, ["router", "disagg_isl_threshold"]),
        ({"router": {"disagg_isl_threshold": 2.5}}, ["router", "disagg_isl_threshold"]),
        ({"router": {"disagg_isl_ratio": 1.5}}, ["router", "disagg_isl_ratio"]),
        ({"router": {"disagg_prefill_busy": 0}}, ["router", "disagg_prefill_busy"]),
        ({"router": {"disagg_decode_busy": 1.01}}, ["router", "disagg_decode_busy"]),
        ({"router": "kv"}, ["router"]),
        ({"placement": {"policy": "random"}}, ["placement", "policy"]),
        ({"placement": {"nodes": ["ghost"]}}, ["placement", "nodes"]),
        ({"placement": {"nodes": ["Not A Node"]}}, ["placement", "nodes"]),
        ({"placement": {"gpus": [0, 0]}}, ["placement", "gpus"]),
        ({"placement": {"gpus": [-1]}}, ["placement", "gpus"]),
        ({"placement": {"gpus": list(range(100))}}, ["placement", "gpus"]),
        ({"placement": {"gpus": [0]}, "groups": [{"gpus_per_replica": 2}]}, ["placement", "gpus"]),
    ],
)
def test_bad_deployments_name_the_field(operator: APIClient, change: dict[str, Any], path: list[Any]) -> None:
    make_model("smol")
    body: Any = errors(operator.post("/api/v1/pipelines/", pipeline_body(**change), format="json"))
    for step in path:
        assert step in body, (path, body)
        body = body[step]


def test_a_taken_pipeline_name_or_namespace_is_a_400(operator: APIClient) -> None:
    deploy("chat", make_model("smol"))
    assert "name" in errors(operator.post("/api/v1/pipelines/", pipeline_body(), format="json"))
    body = errors(operator.post("/api/v1/pipelines/", pipeline_body(name="other", namespace="chat"), format="json"))
    assert "namespace" in body


def test_a_pipeline_name_that_differs_only_in_case_is_a_400_naming_the_pipeline_that_has_it(
    operator: APIClient,
) -> None:
    deploy("chat", make_model("smol"))
    body = errors(operator.post("/api/v1/pipelines/", pipeline_body(name="Chat"), format="json"))
    assert body["name"] == [
        "A pipeline named 'chat' already exists (served names may not differ only in letter case)."
    ], body


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"name": "renamed"}, "name"),
        ({"groups": [{"replicas": 5}]}, "groups"),
        ({"router": {"mode": "smart"}}, "router"),
        ({"placement": {"gpus": [0]}}, "placement"),
    ],
)
def test_bad_pipeline_changes_name_the_field(operator: APIClient, change: dict[str, Any], field: str) -> None:
    pipeline = deploy("chat", gpus_per_replica=2)
    assert field in errors(operator.patch(f"/api/v1/pipelines/{pipeline.pk}/", change, format="json"))


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "replicas"),
        ({"replicas": -1}, "replicas"),
        ({"replicas": "3 please"}, "replicas"),
        ({"replicas": 10_000}, "replicas"),
        ({"replicas": 2, "role": "boss"}, "role"),
        ({"replicas": 2, "role": "decode"}, "role"),
    ],
)
def test_bad_scale_requests_name_the_field(operator: APIClient, body: dict[str, Any], field: str) -> None:
    pipeline = deploy("chat")
    assert field in errors(operator.post(f"/api/v1/pipelines/{pipeline.pk}/scale/", body, format="json"))


def test_actions_on_records_in_the_wrong_state_are_409(operator: APIClient) -> None:
    pipeline = deploy("chat")
    instance = pipeline.instances.get()
    node = make_node("gpu-a", (80,))
    assert operator.post(f"/api/v1/pipelines/{pipeline.pk}/start/").status_code == 409
    assert operator.delete(f"/api/v1/pipelines/{pipeline.pk}/").status_code == 409
    assert operator.post(f"/api/v1/instances/{instance.pk}/restart/").status_code == 409
    assert operator.post(f"/api/v1/nodes/{node.pk}/undrain/").status_code == 409
    response = operator.delete(f"/api/v1/models/{pipeline.model_id}/")
    assert response.status_code == 409
    assert "used by pipelines chat" in response.json()["detail"]


# Tokens


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "kind"),
        ({"kind": "robot"}, "kind"),
        ({"kind": "person"}, "username"),
        ({"kind": "person", "username": "ghost"}, "username"),
        ({"kind": "agent"}, "node_name"),
        ({"kind": "agent", "node_name": "Bad_Name"}, "node_name"),
        ({"kind": "agent", "node_name": "gpu-a", "description": "x" * 300}, "description"),
    ],
)
def test_bad_token_requests_name_the_field(admin: APIClient, body: dict[str, Any], field: str) -> None:
    assert field in errors(admin.post("/api/v1/tokens/", body, format="json"))


# Agent endpoints


GOOD_INVENTORY = {"cpu_count": 8, "gpus": [{"index": 0, "name": "H100", "memory_total_bytes": 80 << 30}]}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"name": None}, "name"),
        ({"name": "GPU_A"}, "name"),
        ({"address": "x" * 300}, "address"),
        ({"labels": ["gpu"]}, "labels"),
        ({"labels": {"bad key!": "x"}}, "labels"),
        ({"labels": {"k": "v" * 300}}, "labels"),
        ({"cpu_count": -2}, "cpu_count"),
        ({"memory_total_bytes": "a lot"}, "memory_total_bytes"),
        ({"gpus": {"index": 0}}, "gpus"),
        ({"gpus": [{"index": 0}]}, "gpus"),
        ({"gpus": [{"index": 0, "memory_total_bytes": 1}, {"index": 0, "memory_total_bytes": 1}]}, "gpus"),
        ({"gpus": [{"index": 0, "memory_total_bytes": 1, "utilization_percent": 101}]}, "gpus"),
        ({"gpus": [{"index": 500, "memory_total_bytes": 1}]}, "gpus"),
        ({"gpus": [{"index": 0, "memory_total_bytes": 1}] * 65}, "gpus"),
        ({"gpus": [{"index": 0, "memory_total_bytes": 1, "uuid": "GPU-1,GPU-2"}]}, "gpus"),
        ({"gpus": [{"index": 0, "memory_total_bytes": 1, "uuid": "G" * 97}]}, "gpus"),
    ],
)
def test_bad_registrations_name_the_field(change: dict[str, Any], field: str) -> None:
    body = {"name": "gpu-a", **GOOD_INVENTORY} | change
    assert field in errors(agent().post("/api/v1/agent/register/", body, format="json"))


def test_a_heartbeat_before_registering_is_a_404_that_says_register() -> None:
    response = agent().post("/api/v1/agent/heartbeat/", GOOD_INVENTORY, format="json")
    assert response.status_code == 404
    assert "register it first" in response.json()["detail"]


@pytest.fixture
def placed() -> Instance:
    make_node("gpu-a", (80,))
    pipeline = deploy("chat", gpus_per_replica=1)
    place_pending_instances(TEST_ACTOR)
    return pipeline.instances.get()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "state"),
        ({"state": "pending"}, "state"),
        ({"state": "stopping"}, "state"),
        ({"state": "failed"}, "reason"),
        ({"state": "ready", "pid": 0}, "pid"),
        ({"state": "ready", "pid": 2**40}, "pid"),
        ({"state": "ready", "endpoint_instance_id": 2**64}, "endpoint_instance_id"),
        ({"state": "ready", "endpoint_instance_id": "abc"}, "endpoint_instance_id"),
        ({"state": "downloading", "download_progress": 2}, "download_progress"),
        ({"state": "ready", "reason": "x" * 5000}, "reason"),
    ],
)
def test_bad_instance_reports_name_the_field(placed: Instance, body: dict[str, Any], field: str) -> None:
    path = f"/api/v1/agent/instances/{placed.pk}/state/"
    assert field in errors(agent().post(path, body, format="json"))


def test_reports_on_unknown_instances_are_404_and_impossible_states_409(placed: Instance) -> None:
    client = agent()
    assert client.post("/api/v1/agent/instances/999/state/", {"state": "ready"}, format="json").status_code == 404
    assert client.post("/api/v1/agent/instances/x/state/", {"state": "ready"}, format="json").status_code == 404
    path = f"/api/v1/agent/instances/{placed.pk}/state/"
    assert client.post(path, {"state": "ready"}, format="json").status_code == 200
    response = client.post(path, {"state": "starting"}, format="json")
    assert response.status_code == 409
    assert "cannot go from ready to starting" in response.json()["detail"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": None, "state": "done"}, "model"),
        ({"model": 999, "state": "done"}, "model"),
        ({"model": "smol", "state": "done"}, "model"),
        ({"state": "exploded"}, "state"),
        ({"state": "downloading", "bytes_done": 11, "bytes_total": 10}, "bytes_done"),
        ({"state": "downloading", "bytes_done": -1}, "bytes_done"),
        ({"state": "done", "projector_bytes": -1}, "projector_bytes"),
        ({"state": "done", "projector_bytes": "big"}, "projector_bytes"),
    ],
)
def test_bad_download_reports_name_the_field(body: dict[str, Any], field: str) -> None:
    make_node("gpu-a", (80,))
    model = make_model("smol")
    body = {"model": model.pk} | body
    assert field in errors(agent().post("/api/v1/agent/downloads/", body, format="json"))


# Garbage of every type into every writable endpoint: never a 500


@pytest.mark.parametrize("value", GARBAGE, ids=repr)
def test_garbage_in_any_field_of_any_endpoint_is_a_client_error(
    operator: APIClient, admin: APIClient, placed: Instance, value: Any
) -> None:
    pipeline = placed.pipeline
    model = pipeline.model
    targets = [
        (operator, "post", "/api/v1/models/", GOOD_MODEL),
        (operator, "patch", f"/api/v1/models/{model.pk}/", GOOD_MODEL),
        (operator, "post", "/api/v1/pipelines/", pipeline_body(model=model.name)),
        (operator, "patch", f"/api/v1/pipelines/{pipeline.pk}/", {"router": {"mode": "kv"}, "placement": {}}),
        (operator, "post", f"/api/v1/pipelines/{pipeline.pk}/scale/", {"replicas": 1, "role": "aggregated"}),
        (admin, "post", "/api/v1/tokens/", {"kind": "agent", "node_name": "gpu-a", "description": ""}),
        (agent(), "post", "/api/v1/agent/register/", {"name": "gpu-a", **GOOD_INVENTORY}),
        (agent(), "post", "/api/v1/agent/heartbeat/", GOOD_INVENTORY),
        (agent(), "post", f"/api/v1/agent/instances/{placed.pk}/state/", {"state": "ready", "pid": 1}),
        (agent(), "post", "/api/v1/agent/downloads/", {"model": model.pk, "state": "done"}),
    ]
    for client, method, path, good in targets:
        for field in good:
            response = getattr(client, method)(path, good | {field: value}, format="json")
            assert response.status_code < 500, (path, field, response.content)
        response = getattr(client, method)(path, value, format="json")
        assert response.status_code < 500, (path, response.content)


def test_replacing_a_whole_record_with_put_is_not_offered(operator: APIClient) -> None:
    model = make_model("smol")
    assert operator.put(f"/api/v1/models/{model.pk}/", GOOD_MODEL, format="json").status_code == 405
