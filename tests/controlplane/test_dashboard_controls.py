"""The dashboard's buttons (scale, stop, start, restart, drain, undrain): htmx POSTs that call the actions
and answer with the record's fresh partial and a note; read-only people and requests without a CSRF
token are refused and change nothing."""

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from django.test import Client

from controlplane.accounts.models import Role
from controlplane.audit.models import AuditEntry
from controlplane.deployments.instance_states import InstanceState
from controlplane.deployments.models import Instance, Pipeline
from controlplane.deployments.upkeep import place_pending_instances
from controlplane.fleet.models import Node
from tests.controlplane.factories import TEST_ACTOR, deploy, make_node, run_instance
from tests.controlplane.test_dashboard import logged_in

pytestmark = pytest.mark.django_db

HTMX = {"HTTP_HX_REQUEST": "true"}


@dataclass
class Fleet:
    node: Node
    pipeline: Pipeline
    instance: Instance


@pytest.fixture
def fleet() -> Fleet:
    node = make_node("gpu-a", gpus_gib=(24, 24))
    pipeline = deploy("chat", replicas=1, gpus_per_replica=1)
    place_pending_instances(TEST_ACTOR)
    instance = run_instance(Instance.objects.select_related("node", "pipeline", "group").get())
    return Fleet(node, pipeline, instance)


def live_instances(pipeline: Pipeline) -> int:
    return pipeline.instances.exclude(state__in=[InstanceState.STOPPING, InstanceState.STOPPED]).count()


def test_scaling_adds_instances_and_answers_with_the_fresh_row(fleet: Fleet) -> None:
    browser = logged_in(Role.OPERATOR, username="olga")
    response = browser.post(f"/pipelines/{fleet.pipeline.pk}/scale/", {"replicas": "3"}, **HTMX)
    assert response.status_code == 200
    html = response.content.decode()
    assert html.startswith(f'<div id="pipeline-{fleet.pipeline.pk}" class="tr" role="row">') and "1 / 3" in html
    assert '<div id="flash"' in html and 'hx-swap-oob="true"' in html and "chat scaled to 3." in html
    assert f'id="instances-{fleet.pipeline.pk}"' not in html  # the list page has no instance list
    assert live_instances(fleet.pipeline) == 3
    assert AuditEntry.objects.get(action="pipeline.scale").actor_name == "olga"


def test_scaling_from_the_pipeline_page_also_sends_its_new_instance_list(fleet: Fleet) -> None:
    page = f"http://testserver/pipelines/{fleet.pipeline.pk}/"
    response = logged_in(Role.OPERATOR).post(
        f"/pipelines/{fleet.pipeline.pk}/scale/", {"replicas": "2"}, HTTP_HX_CURRENT_URL=page, **HTMX
    )
    html = response.content.decode()
    assert f'<div id="instances-{fleet.pipeline.pk}" hx-swap-oob="true">' in html
    new = Instance.objects.exclude(pk=fleet.instance.pk).get()
    assert f'<div id="instance-{new.pk}" class="tr" role="row">' in html


@pytest.mark.parametrize("replicas", ["-1", "513", "two", ""])
def test_a_bad_replica_count_is_refused_with_the_reason_and_changes_nothing(fleet: Fleet, replicas: str) -> None:
    response = logged_in(Role.OPERATOR).post(f"/pipelines/{fleet.pipeline.pk}/scale/", {"replicas": replicas}, **HTMX)
    assert response.status_code == 400
    html = response.content.decode()
    assert "Not scaled: replicas:" in html and f'<div id="pipeline-{fleet.pipeline.pk}" class="tr" role="row">' in html
    assert fleet.pipeline.groups.get().replicas == 1 and live_instances(fleet.pipeline) == 1


def test_stop_then_start_and_a_second_stop_is_a_conflict_with_its_reason(fleet: Fleet) -> None:
    browser = logged_in(Role.ADMIN)
    stopped = browser.post(f"/pipelines/{fleet.pipeline.pk}/stop/", **HTMX)
    assert stopped.status_code == 200 and "chat stopped." in stopped.content.decode()
    assert Pipeline.objects.get().state == "stopped" and live_instances(fleet.pipeline) == 0
    again = browser.post(f"/pipelines/{fleet.pipeline.pk}/stop/", **HTMX)
    assert again.status_code == 409 and "pipeline chat is stopped already" in again.content.decode()
    started = browser.post(f"/pipelines/{fleet.pipeline.pk}/start/", **HTMX)
    assert started.status_code == 200 and Pipeline.objects.get().state == "running"
    assert live_instances(fleet.pipeline) == 1


def test_restarting_an_instance_answers_with_its_row(fleet: Fleet) -> None:
    response = logged_in(Role.OPERATOR).post(f"/instances/{fleet.instance.pk}/restart/", **HTMX)
    assert response.status_code == 200
    html = response.content.decode()
    # The only replica: it serves on while its replacement starts.
    assert html.startswith(f'<div id="instance-{fleet.instance.pk}" class="tr"') and "state-ready" in html
    assert Instance.objects.get(replaces=fleet.instance).state == "pending"
    conflict = logged_in(Role.OPERATOR, username="other").post(f"/instances/{fleet.instance.pk}/restart/", **HTMX)
    assert conflict.status_code == 409 and "is being replaced already" in conflict.content.decode()


def test_draining_and_undraining_a_node(fleet: Fleet) -> None:
    make_node("gpu-b", gpus_gib=(24,))
    browser = logged_in(Role.OPERATOR)
    drained = browser.post(f"/nodes/{fleet.node.pk}/drain/", **HTMX)
    html = drained.content.decode()
    assert drained.status_code == 200
    assert html.startswith(f'<div id="node-{fleet.node.pk}" class="tr"') and "Undrain" in html
    assert "stops once its replacement elsewhere is ready" in html
    assert Node.objects.get(name="gpu-a").draining and Instance.objects.get(pk=fleet.instance.pk).state == "ready"
    undrained = browser.post(f"/nodes/{fleet.node.pk}/undrain/", **HTMX)
    assert undrained.status_code == 200 and not Node.objects.get(name="gpu-a").draining


def test_draining_the_last_place_a_pipeline_fits_warns_and_offers_to_drain_anyway(fleet: Fleet) -> None:
    browser = logged_in(Role.OPERATOR)
    refused = browser.post(f"/nodes/{fleet.node.pk}/drain/", **HTMX)
    html = refused.content.decode()
    assert refused.status_code == 409
    assert "draining gpu-a would stop pipeline chat" in html and "Drain anyway" in html
    assert not Node.objects.get().draining and Instance.objects.get().state == "ready"

    forced = browser.post(f"/nodes/{fleet.node.pk}/drain/", {"force": "1"}, **HTMX)

    assert forced.status_code == 200 and "their replacements wait for room" in forced.content.decode()
    assert Node.objects.get().draining and Instance.objects.get(pk=fleet.instance.pk).state == "stopping"


def test_cordoning_and_uncordoning_a_node(fleet: Fleet) -> None:
    browser = logged_in(Role.OPERATOR)
    cordoned = browser.post(f"/nodes/{fleet.node.pk}/cordon/", **HTMX)
    assert cordoned.status_code == 200 and "Uncordon" in cordoned.content.decode()
    assert Node.objects.get().cordoned and Instance.objects.get().state == "ready"
    uncordoned = browser.post(f"/nodes/{fleet.node.pk}/uncordon/", **HTMX)
    assert uncordoned.status_code == 200 and not Node.objects.get().cordoned


def test_without_htmx_a_button_redirects_to_the_records_page_with_the_note(fleet: Fleet) -> None:
    browser = logged_in(Role.OPERATOR)
    response = browser.post(f"/nodes/{fleet.node.pk}/drain/")
    assert (response.status_code, response["Location"]) == (302, "/nodes/")
    assert "gpu-a is draining" in browser.get("/nodes/").content.decode()


BUTTONS: list[Callable[[Fleet], str]] = [
    lambda fleet: f"/pipelines/{fleet.pipeline.pk}/scale/",
    lambda fleet: f"/pipelines/{fleet.pipeline.pk}/stop/",
    lambda fleet: f"/pipelines/{fleet.pipeline.pk}/start/",
    lambda fleet: f"/instances/{fleet.instance.pk}/restart/",
    lambda fleet: f"/nodes/{fleet.node.pk}/drain/",
    lambda fleet: f"/nodes/{fleet.node.pk}/undrain/",
    lambda fleet: f"/nodes/{fleet.node.pk}/cordon/",
    lambda fleet: f"/nodes/{fleet.node.pk}/uncordon/",
]


def refused_and_unchanged(fleet: Fleet, browser: Client, url: str) -> None:
    entries = AuditEntry.objects.count()
    response = browser.post(url, {"replicas": "2"}, **HTMX)
    assert response.status_code == 403
    assert AuditEntry.objects.count() == entries
    assert live_instances(fleet.pipeline) == 1 and not Node.objects.get().draining


@pytest.mark.parametrize("button", BUTTONS)
def test_read_only_people_get_403_from_every_button_and_nothing_changes(
    fleet: Fleet, button: Callable[..., str]
) -> None:
    refused_and_unchanged(fleet, logged_in(Role.READ_ONLY), button(fleet))


@pytest.mark.parametrize("button", BUTTONS)
def test_a_button_without_the_csrf_token_is_refused(fleet: Fleet, button: Callable[..., str]) -> None:
    refused_and_unchanged(fleet, logged_in(Role.ADMIN, enforce_csrf_checks=True), button(fleet))


def test_with_the_csrf_header_htmx_sends_a_button_goes_through(fleet: Fleet) -> None:
    browser = logged_in(Role.ADMIN, enforce_csrf_checks=True)
    page = browser.get("/nodes/")
    token = str(page.context["csrf_token"])
    assert f'hx-headers=\'{{"X-CSRFToken": "{token}"}}\'' in page.content.decode()
    response = browser.post(f"/nodes/{fleet.node.pk}/drain/", {"force": "1"}, HTTP_X_CSRFTOKEN=token, **HTMX)
    assert response.status_code == 200 and Node.objects.get().draining


def test_buttons_are_posts_only_and_anonymous_posts_go_to_the_login_page(fleet: Fleet) -> None:
    assert logged_in(Role.ADMIN).get(f"/nodes/{fleet.node.pk}/drain/").status_code == 405
    response = Client().post(f"/nodes/{fleet.node.pk}/drain/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")
    assert not Node.objects.get().draining
