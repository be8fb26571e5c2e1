"""The planner through the REST API: a pipeline's targets (PATCH), its decisions, and a model's profile."""

import datetime
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.audit.models import AuditEntry
from controlplane.catalog.models import LanguageModel
from controlplane.deployments.models import Pipeline
from controlplane.planning.actions import Seen, apply_decisions
from controlplane.planning.models import KEEP_PER_PIPELINE, PlannerDecision
from planner.decision import Decision
from tests.controlplane.factories import deploy, make_model

pytestmark = pytest.mark.django_db

PROFILE: dict[str, Any] = {
    "version": 1,
    "gpus_per_replica": 1,
    "prefill": {"ttft_s": 0.5, "points": [{"isl": 512, "tokens_per_s": 21000}, {"isl": 4096, "tokens_per_s": 15500}]},
    "decode": {"itl_s": 0.05, "points": [{"context_tokens": 1024, "tokens_per_s": 4200}]},
}


def test_a_pipelines_planner_targets_are_set_by_patch_and_read_back(operator: APIClient) -> None:
    pipeline = deploy("chat")
    targets = {
        "advisory": True,
        "default": {"ttft_s": 0.5, "itl_s": 0.05},
        "groups": {"aggregated": {"max_replicas": 3}},
    }

    response = operator.patch(f"/api/v1/pipelines/{pipeline.pk}/", {"planner": targets}, format="json")

    assert response.status_code == 200, response.content
    assert response.json()["planner"] == targets
    assert operator.get(f"/api/v1/pipelines/{pipeline.pk}/").json()["planner"] == targets
    assert AuditEntry.objects.filter(action="pipeline.update", target_id=str(pipeline.pk)).exists()


def test_null_turns_the_planner_off(operator: APIClient) -> None:
    pipeline = deploy("chat", planner={"default": {"ttft_s": 0.5}})
    response = operator.patch(f"/api/v1/pipelines/{pipeline.pk}/", {"planner": None}, format="json")
    assert response.status_code == 200, response.content
    pipeline.refresh_from_db()
    assert pipeline.planner is None


@pytest.mark.parametrize(
    ("targets", "path"),
    [
        ({"default": {"ttft_s": -1}}, "default.ttft_s"),
        ({"groups": {"prefill": {"ttft_s": "fast"}}}, "groups.prefill.ttft_s"),
        ({"groups": {"encode": {}}}, "groups.encode"),
        ({"stability": {"cooldown_s": -5}}, "stability.cooldown_s"),
        ({"enabled": "yes"}, "enabled"),
        ({"default": {"ttft": 1}}, "default.ttft"),
    ],
)
def test_targets_the_planner_cannot_plan_with_are_a_400_naming_the_path(
    operator: APIClient, targets: dict[str, Any], path: str
) -> None:
    pipeline = deploy("chat")
    response = operator.patch(f"/api/v1/pipelines/{pipeline.pk}/", {"planner": targets}, format="json")
    assert response.status_code == 400, response.content
    assert path in response.json()["planner"]
    pipeline.refresh_from_db()
    assert pipeline.planner is None


def test_a_planner_document_that_is_not_an_object_is_a_400(operator: APIClient) -> None:
    pipeline = deploy("chat")
    response = operator.patch(f"/api/v1/pipelines/{pipeline.pk}/", {"planner": [1, 2]}, format="json")
    assert response.status_code == 400
    assert "planner" in response.json()


def test_a_reader_may_not_change_the_targets(reader: APIClient) -> None:
    pipeline = deploy("chat")
    response = reader.patch(f"/api/v1/pipelines/{pipeline.pk}/", {"planner": {}}, format="json")
    assert response.status_code == 403


def decide(pipeline: Pipeline, at: datetime.datetime, desired: int = 1) -> None:
    decision = Decision("aggregated", 1, desired, desired, "load", f"decided at {at.isoformat()}", advisory=True)
    apply_decisions(pipeline.pk, [decision], Seen(percentile=90, ttft_s=0.2), at)


def test_the_decisions_endpoint_lists_the_latest_first_a_page_at_a_time(reader: APIClient) -> None:
    pipeline = deploy("chat")
    start = timezone.now()
    for second in range(3):
        decide(pipeline, start + datetime.timedelta(seconds=second))

    response = reader.get(f"/api/v1/pipelines/{pipeline.pk}/planner/decisions/?page_size=2")

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["count"] == 3
    assert [row["reason"] for row in body["results"]] == [
        f"decided at {(start + datetime.timedelta(seconds=s)).isoformat()}" for s in (2, 1)
    ]
    first = body["results"][0]
    assert (first["role"], first["mode"], first["advisory"], first["acted"], first["ttft_s"]) == (
        "aggregated",
        "load",
        True,
        False,
        0.2,
    )
    assert body["next"] is not None


def test_the_decisions_of_an_unknown_pipeline_are_a_404(reader: APIClient) -> None:
    assert reader.get("/api/v1/pipelines/999/planner/decisions/").status_code == 404


def test_each_pipeline_keeps_a_bounded_history_of_decisions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("controlplane.planning.actions.KEEP_PER_PIPELINE", 3)
    pipeline = deploy("chat")
    start = timezone.now()
    for second in range(5):
        decide(pipeline, start + datetime.timedelta(seconds=second))
    kept = list(PlannerDecision.objects.filter(pipeline=pipeline).values_list("at", flat=True))
    assert kept == [start + datetime.timedelta(seconds=s) for s in (4, 3, 2)]
    assert KEEP_PER_PIPELINE >= 100


def test_a_models_profile_is_put_read_and_deleted(operator: APIClient) -> None:
    model = make_model("smol")
    url = f"/api/v1/models/{model.pk}/profile/"
    assert operator.get(url).status_code == 404

    put = operator.put(url, PROFILE, format="json")

    assert put.status_code == 200, put.content
    assert operator.get(url).json() == PROFILE
    assert AuditEntry.objects.filter(action="model.profile").exists()
    assert operator.delete(url).status_code == 204
    assert LanguageModel.objects.get(pk=model.pk).profile is None


def test_a_bad_profile_is_a_400_with_each_problem_under_its_path(operator: APIClient) -> None:
    model = make_model("smol")
    bad = PROFILE | {
        "decode": {"itl_s": 0.05, "points": [{"context_tokens": 1024, "tokens_per_s": 4200}, {"context_tokens": 512}]}
    }

    response = operator.put(f"/api/v1/models/{model.pk}/profile/", bad, format="json")

    assert response.status_code == 400
    errors = response.json()
    assert "decode.points[1].tokens_per_s" in errors
    assert LanguageModel.objects.get(pk=model.pk).profile is None


def test_a_profile_that_is_not_an_object_is_a_400(operator: APIClient) -> None:
    model = make_model("smol")
    response = operator.put(f"/api/v1/models/{model.pk}/profile/", [1], format="json")
    assert response.status_code == 400
    assert response.json() == {"non_field_errors": ["must be an object"]}


def test_a_reader_may_read_a_profile_but_not_change_it(reader: APIClient) -> None:
    model = make_model("smol")
    assert reader.put(f"/api/v1/models/{model.pk}/profile/", PROFILE, format="json").status_code == 403
    assert reader.get(f"/api/v1/models/{model.pk}/profile/").status_code == 404


def test_a_model_is_not_replaced_whole_by_put(operator: APIClient) -> None:
    model = make_model("smol")
    response = operator.put(f"/api/v1/models/{model.pk}/", {"name": "x"}, format="json")
    assert response.status_code == 405


def test_the_schema_describes_the_planner_endpoints(reader: APIClient) -> None:
    schema = reader.get("/api/v1/schema/?format=json").json()
    assert "/api/v1/pipelines/{pipeline_pk}/planner/decisions/" in schema["paths"]
    assert set(schema["paths"]["/api/v1/models/{id}/profile/"]) >= {"get", "put", "delete"}
    assert "put" not in schema["paths"]["/api/v1/models/{id}/"]
