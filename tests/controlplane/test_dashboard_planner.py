"""The dashboard's planner panel on the pipeline page (its form included) and the model page's profile."""

import json

import pytest
from django.utils import timezone

from controlplane.accounts.models import Role
from controlplane.catalog.models import LanguageModel
from controlplane.deployments.models import Pipeline
from controlplane.live.rendering import render_each
from controlplane.planning.actions import Seen, apply_decisions
from planner.decision import Decision
from tests.controlplane.factories import deploy, make_model
from tests.controlplane.test_api_planner import PROFILE
from tests.controlplane.test_dashboard import logged_in

pytestmark = pytest.mark.django_db


def test_the_panel_shows_targets_the_latest_measurement_and_the_decisions_with_their_reasons() -> None:
    pipeline = deploy("chat", planner={"advisory": True, "default": {"ttft_s": 0.5, "itl_s": 0.05}})
    decision = Decision("aggregated", 1, 2, 2, "load", "instance 7's KV usage 95% at or over 80%", advisory=True)
    apply_decisions(
        pipeline.pk, [decision], Seen(percentile=90, ttft_s=0.82, itl_s=0.01, predicted_rate=3.5), timezone.now()
    )

    page = logged_in(Role.READ_ONLY).get(f"/pipelines/{pipeline.pk}/").content.decode()

    assert f'id="planner-{pipeline.pk}"' in page
    assert "Planner: <strong>advisory</strong>" in page
    assert "TTFT 0.5 s" in page and "0.820 s" in page and "over target" in page
    assert "3.50 req/s" in page
    assert "instance 7&#x27;s KV usage 95% at or over 80%" in page


def test_the_live_push_renders_the_same_panel() -> None:
    pipeline = deploy("chat", planner={})
    (html,) = render_each([("planner", pipeline.pk)], can_act=True)
    assert html.startswith(f'<div id="planner-{pipeline.pk}"')


def test_the_form_turns_the_planner_on_keeping_the_rest_of_the_document() -> None:
    pipeline = deploy("chat", planner={"enabled": False, "groups": {"aggregated": {"max_replicas": 3}}})
    client = logged_in(Role.OPERATOR)

    response = client.post(
        f"/pipelines/{pipeline.pk}/planner/",
        {"mode": "on", "ttft_s": "0.4", "itl_s": "", "min_replicas": "1", "max_replicas": "6"},
        HTTP_HX_REQUEST="true",
    )

    assert response.status_code == 200, response.content
    pipeline = Pipeline.objects.get(pk=pipeline.pk)
    assert pipeline.planner == {
        "enabled": True,
        "advisory": False,
        "groups": {"aggregated": {"max_replicas": 3}},
        "default": {"ttft_s": 0.4, "itl_s": None, "min_replicas": 1, "max_replicas": 6},
    }


def test_the_form_refuses_targets_the_planner_cannot_plan_with_saying_which() -> None:
    pipeline = deploy("chat")
    response = logged_in(Role.OPERATOR).post(
        f"/pipelines/{pipeline.pk}/planner/",
        {"mode": "on", "min_replicas": "5", "max_replicas": "2"},
        HTTP_HX_REQUEST="true",
    )
    assert response.status_code == 400
    assert "max_replicas (2) must be at least min_replicas (5)" in response.content.decode()
    assert Pipeline.objects.get(pk=pipeline.pk).planner is None


def test_a_reader_may_not_use_the_form() -> None:
    pipeline = deploy("chat")
    response = logged_in(Role.READ_ONLY).post(f"/pipelines/{pipeline.pk}/planner/", {"mode": "on"})
    assert response.status_code == 403


def test_the_model_page_takes_a_pasted_profile_and_shows_it() -> None:
    model = make_model("smol")
    client = logged_in(Role.OPERATOR)

    response = client.post(f"/models/{model.pk}/", {"profile": json.dumps(PROFILE)})

    assert response.status_code == 302
    assert LanguageModel.objects.get(pk=model.pk).profile == PROFILE
    assert "21000" in client.get(f"/models/{model.pk}/").content.decode()


def test_the_model_page_shows_each_problem_of_a_bad_profile_with_its_path() -> None:
    model = make_model("smol")
    bad = PROFILE | {"prefill": {"ttft_s": -1, "points": []}}
    response = logged_in(Role.OPERATOR).post(f"/models/{model.pk}/", {"profile": json.dumps(bad)})
    assert response.status_code == 400
    page = response.content.decode()
    assert "prefill.ttft_s: must be a positive number of seconds" in page
    assert LanguageModel.objects.get(pk=model.pk).profile is None
