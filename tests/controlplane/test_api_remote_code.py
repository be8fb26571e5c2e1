"""trust_remote_code through the REST API: only admins may turn it on, each change has an audit entry of its own."""

from typing import Any

import pytest
from rest_framework.test import APIClient

from controlplane.audit.models import AuditEntry
from controlplane.catalog.models import LanguageModel
from controlplane.catalog.remote_code import trusts_remote_code
from controlplane.deployments.models import Pipeline
from tests.controlplane.factories import make_model

pytestmark = pytest.mark.django_db

MODEL = {"name": "custom", "source_kind": "hf", "source": "acme/custom-arch", "engine": "mocker"}


def deploy_body(engine_args: dict[str, Any]) -> dict[str, Any]:
    return {"name": "chat", "model": "smol", "groups": [{"replicas": 1, "engine_args": engine_args}]}


def remote_code_entries() -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    return [
        (entry.action, entry.actor_name, entry.before, entry.after)
        for entry in AuditEntry.objects.filter(action__endswith=".trust_remote_code").order_by("id")
    ]


@pytest.mark.parametrize(
    "args",
    [
        {"trust_remote_code": True},
        {"trust-remote-code": True},
        {"--trust-remote-code": True},
        {"trust_remote_code": "yes"},
        {"trust_remote_code": 1},
        {"--extra-engine-args": '{"trust_remote_code": true}'},
        {"--extra-engine-args": "{trust_remote_code: on}"},  # YAML, as TensorRT-LLM reads it
        {"model_loader_extra_config": {"trust_remote_code": True}},
    ],
)
def test_an_operator_deploying_a_group_that_trusts_remote_code_gets_a_403_saying_why(
    operator: APIClient, args: dict[str, Any]
) -> None:
    make_model("smol")
    response = operator.post("/api/v1/pipelines/", deploy_body(args), format="json")
    assert response.status_code == 403, response.content
    detail = response.json()["detail"]
    assert "trust_remote_code" in detail and "Only an admin may allow that" in detail
    assert not Pipeline.objects.exists() and remote_code_entries() == []


@pytest.mark.parametrize(
    "args", [{"trust_remote_code": False}, {"trust_remote_code": "false"}, {"trust_remote_code": None}, {}]
)
def test_an_operator_may_deploy_with_remote_code_left_off(operator: APIClient, args: dict[str, Any]) -> None:
    make_model("smol")
    assert operator.post("/api/v1/pipelines/", deploy_body(args), format="json").status_code == 201
    assert remote_code_entries() == []


def test_an_admin_deploying_a_group_that_trusts_remote_code_is_audited(admin: APIClient) -> None:
    make_model("smol")
    response = admin.post("/api/v1/pipelines/", deploy_body({"trust_remote_code": True}), format="json")
    assert response.status_code == 201, response.content
    [(action, actor, before, after)] = remote_code_entries()
    assert (action, before) == ("pipeline.trust_remote_code", {"trust_remote_code": False})
    assert after == {"trust_remote_code": True, "where": "the aggregated group's engine_args"}
    assert actor.startswith("admin-")


def test_an_operator_may_not_turn_it_on_in_a_group_update_but_may_turn_it_off(
    operator: APIClient, admin: APIClient
) -> None:
    make_model("smol")
    pipeline = operator.post("/api/v1/pipelines/", deploy_body({}), format="json").json()
    update = f"/api/v1/pipelines/{pipeline['id']}/update-group/"
    refused = operator.post(update, {"engine_args": {"trust_remote_code": True}}, format="json")
    assert refused.status_code == 403 and "trust_remote_code" in refused.json()["detail"]
    assert Pipeline.objects.get().groups.get().engine_args == {}

    assert admin.post(update, {"engine_args": {"trust_remote_code": True}}, format="json").status_code == 200
    # Left on, other args changed: nothing new to allow.
    kept = {"trust_remote_code": True, "speedup_ratio": 2}
    assert operator.post(update, {"engine_args": kept}, format="json").status_code == 200
    assert operator.post(update, {"engine_args": {"speedup_ratio": 2}}, format="json").status_code == 200
    assert [(action, after["trust_remote_code"]) for action, _, _, after in remote_code_entries()] == [
        ("pipeline.trust_remote_code", True),
        ("pipeline.trust_remote_code", False),
    ]


def test_only_an_admin_may_put_it_in_a_models_default_engine_args(operator: APIClient, admin: APIClient) -> None:
    body = MODEL | {"default_engine_args": {"trust_remote_code": True}}
    refused = operator.post("/api/v1/models/", body, format="json")
    assert refused.status_code == 403 and "default engine args turn on trust_remote_code" in refused.json()["detail"]
    assert not LanguageModel.objects.exists()

    created = admin.post("/api/v1/models/", body, format="json")
    assert created.status_code == 201, created.content
    assert [(action, after) for action, _, _, after in remote_code_entries()] == [
        ("model.trust_remote_code", {"trust_remote_code": True, "where": "default_engine_args"})
    ]


def test_an_operator_may_not_point_a_model_that_trusts_remote_code_at_another_source(
    operator: APIClient, admin: APIClient
) -> None:
    model = admin.post(
        "/api/v1/models/", MODEL | {"default_engine_args": {"trust_remote_code": True}}, format="json"
    ).json()
    path = f"/api/v1/models/{model['id']}/"
    for change in ({"source": "mallory/custom-arch"}, {"revision": "evil-branch"}):
        refused = operator.patch(path, change, format="json")
        assert refused.status_code == 403, refused.content
        assert "a new source for a model whose default engine args" in refused.json()["detail"]
    assert LanguageModel.objects.get().source == "acme/custom-arch"
    # Other fields stay an operator's to change.
    assert operator.patch(path, {"context_length": 4096}, format="json").status_code == 200
    assert admin.patch(path, {"source": "acme/custom-arch-v2"}, format="json").status_code == 200
    assert remote_code_entries()[-1][3] == {"trust_remote_code": True, "where": "default_engine_args",
                                            "source_changed": True}  # fmt: skip


def test_a_group_of_a_model_an_admin_trusted_needs_no_admin_to_deploy(operator: APIClient, admin: APIClient) -> None:
    admin.post("/api/v1/models/", MODEL | {"default_engine_args": {"trust_remote_code": True}}, format="json")
    body = {"name": "chat", "model": "custom", "groups": [{"replicas": 1}]}
    assert operator.post("/api/v1/pipelines/", body, format="json").status_code == 201


def test_the_decision_reads_no_mention_of_the_key_as_on() -> None:
    assert not trusts_remote_code({"tokenizer": "trust_remote_code", "--extra-engine-args": '{"seed": 1}'})
    assert not trusts_remote_code({"--extra-engine-args": '{"trust_remote_code": false}'})
