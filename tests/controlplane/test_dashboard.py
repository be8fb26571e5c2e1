"""The dashboard's pages: login required, every page for every role, and what the overview shows."""

import pytest
from django.test import Client

from controlplane.accounts.models import Role
from controlplane.audit.records import Actor
from controlplane.deployments.models import Instance
from controlplane.deployments.pipelines import GroupSpec, deploy_pipeline
from controlplane.deployments.upkeep import place_pending_instances
from controlplane.fleet.actions import report_download
from controlplane.fleet.models import Download
from runtime.fleet_contract.reports import DownloadReport
from tests.controlplane.factories import TEST_ACTOR, deploy, make_model, make_node, make_user, run_instance

pytestmark = pytest.mark.django_db

PEOPLE = [Role.READ_ONLY, Role.OPERATOR, Role.ADMIN]
PASSWORD = "a long passphrase"


def logged_in(role: Role, *, enforce_csrf_checks: bool = False, username: str | None = None) -> Client:
    """A browser logged in as a new person with ``role``."""
    user = make_user(username or f"{role.value}-person", role)
    user.set_password(PASSWORD)
    user.save()
    client = Client(enforce_csrf_checks=enforce_csrf_checks)
    assert client.login(username=user.username, password=PASSWORD)
    return client


def a_small_fleet() -> dict[str, int]:
    """A node with a GPU, a pipeline with a ready instance, another that cannot be placed, a download."""
    node = make_node("gpu-a", gpus_gib=(24,))
    chat = deploy("chat", replicas=1, gpus_per_replica=1)
    deploy("big", replicas=1, gpus_per_replica=4)
    place_pending_instances(Actor.system("test"))
    instance = run_instance(Instance.objects.select_related("node", "pipeline", "group").get(pipeline=chat))
    report_download(
        Actor.agent("gpu-a"), "gpu-a", chat.model_id, DownloadReport(state="downloading", bytes_done=5, bytes_total=10)
    )
    return {"node": node.pk, "pipeline": chat.pk, "instance": instance.pk, "download": Download.objects.get().pk}


PAGES = ["/", "/models/", "/pipelines/", "/pipelines/{pipeline}/", "/nodes/"]


def test_anonymous_visitors_are_sent_to_the_login_page_and_come_back_after_it() -> None:
    client = Client()
    response = client.get("/")
    assert (response.status_code, response["Location"]) == (302, "/login/?next=/")
    user = make_user("bob")
    user.set_password(PASSWORD)
    user.save()
    refused = client.post("/login/?next=/", {"username": "bob", "password": "wrong"})
    assert refused.status_code == 200 and b"do not match an account" in refused.content
    accepted = client.post("/login/", {"username": "bob", "password": PASSWORD, "next": "/"})
    assert (accepted.status_code, accepted["Location"]) == (302, "/")


@pytest.mark.parametrize("page", [*PAGES, "/audit/", "/gateway/", "/instances/{instance}/log/"])
def test_every_page_sends_anonymous_visitors_to_the_login_page(page: str) -> None:
    url = page.format(**a_small_fleet())
    response = Client().get(url)
    assert response.status_code == 302 and response["Location"].startswith("/login/?next=")


@pytest.mark.parametrize("role", PEOPLE)
@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_for_every_role(page: str, role: Role) -> None:
    fleet = a_small_fleet()
    response = logged_in(role).get(page.format(**fleet))
    assert response.status_code == 200
    html = response.content.decode()
    assert "{#" not in html and "{%" not in html  # no template syntax left over
    # Only operators' pages have controls (tests/controlplane/test_dashboard_controls_by_role.py).
    assert ("(read-only)" in html) == (role == Role.READ_ONLY)


@pytest.mark.parametrize(
    ("page", "form_action"), [("/models/", 'action="/models/"'), ("/pipelines/", 'action="/pipelines/"')]
)
def test_read_only_people_get_no_forms_and_operators_do(page: str, form_action: str) -> None:
    make_model("smol")
    assert form_action not in logged_in(Role.READ_ONLY).get(page).content.decode()
    assert form_action in logged_in(Role.OPERATOR).get(page).content.decode()


def test_the_audit_log_needs_the_operator_role_as_in_the_api() -> None:
    assert logged_in(Role.READ_ONLY).get("/audit/").status_code == 403
    assert logged_in(Role.OPERATOR).get("/audit/").status_code == 200
    reader_overview = logged_in(Role.READ_ONLY, username="reader-2").get("/").content.decode()
    assert "The audit log needs the operator role." in reader_overview and 'id="audit-feed"' not in reader_overview


def test_an_empty_fleet_says_what_to_do_next() -> None:
    page = logged_in(Role.OPERATOR).get("/").content.decode()
    assert "No pipelines yet" in page and "No nodes yet: start an agent with" in page
    assert "Nothing has happened yet." in page
    assert "No models yet: add one below" in logged_in(Role.ADMIN).get("/models/").content.decode()
    assert "No nodes yet: start an agent with" in logged_in(Role.READ_ONLY).get("/nodes/").content.decode()


def test_the_overview_shows_nodes_gpus_pipelines_ready_over_desired_and_why_the_rest_wait() -> None:
    make_node("gpu-a", gpus_gib=(24,))
    ready = deploy("chat", replicas=1, gpus_per_replica=1)
    waiting = deploy("big", replicas=1, gpus_per_replica=4)
    place_pending_instances(Actor.system("test"))
    run_instance(Instance.objects.get(pipeline=ready))
    page = logged_in(Role.OPERATOR).get("/").content.decode()
    assert "gpu-a" in page and "#0" in page and "24 GiB" in page
    # chat: its one replica is ready; big cannot be placed, and the page says why.
    assert '<div class="td full" role="cell">1 / 1</div>' in page
    assert '<div class="td short" role="cell">0 / 1</div>' in page and "1 pending" in page
    reason = Instance.objects.get(pipeline=waiting).reason
    assert reason and reason in page
    assert "pipeline.deploy" in page  # the audit log's latest events, in the live feed
    assert '<ul id="audit-feed" class="feed">' in page


def test_pages_that_show_live_data_connect_to_their_websocket_naming_only_what_they_show() -> None:
    fleet = a_small_fleet()
    browser = logged_in(Role.READ_ONLY)
    topics = {"/nodes/": "nodes", "/pipelines/": "pipelines", "/models/": "models,downloads"}
    for page, shown in topics.items():
        assert f'hx-ext="ws" ws-connect="/ws/fleet/?topics={shown}"' in browser.get(page).content.decode()
    # The overview's recent events are for those who may read the audit log.
    assert 'ws-connect="/ws/fleet/?topics=nodes,pipelines,load"' in browser.get("/").content.decode()
    operator = logged_in(Role.OPERATOR).get("/").content.decode()
    assert 'ws-connect="/ws/fleet/?topics=nodes,pipelines,load,audit"' in operator
    detail = browser.get(f"/pipelines/{fleet['pipeline']}/").content.decode()
    assert f'hx-ext="ws" ws-connect="/ws/pipelines/{fleet["pipeline"]}/"' in detail


def test_the_pages_include_the_partials_the_live_updates_replace() -> None:
    fleet = a_small_fleet()
    browser = logged_in(Role.OPERATOR)
    overview = browser.get("/").content.decode()
    for element in (f"node-{fleet['node']}", f"pipeline-{fleet['pipeline']}"):
        assert f'<div id="{element}" class="tr" role="row">' in overview
    models = browser.get("/models/").content.decode()
    assert f'<div id="download-{fleet["download"]}" class="tr" role="row">' in models
    detail = browser.get(f"/pipelines/{fleet['pipeline']}/").content.decode()
    instance = fleet["instance"]
    assert f'<div id="instance-{instance}" class="tr" role="row">' in detail and f'<div id="load-{instance}"' in detail
    assert f'<div id="instances-{fleet["pipeline"]}">' in detail
    assert f'data-instance="{instance}" data-chart="cache"' in detail  # where charts.js draws
    assert "uPlot.iife.min.js" in detail and "charts.js" in detail


def test_the_pipeline_page_shows_its_settings_and_why_an_instance_waits() -> None:
    make_node("gpu-a", gpus_gib=(24,))
    big = deploy(
        "big", replicas=1, gpus_per_replica=4, router_mode="kv", router_temperature=0.5, kv_queued_prefill_weight=0.25
    )
    place_pending_instances(TEST_ACTOR)
    page = logged_in(Role.READ_ONLY).get(f"/pipelines/{big.pk}/").content.decode()
    reason = Instance.objects.get(pipeline=big).reason
    assert reason and page.count(reason) >= 2  # in the pipeline's row and in the instance's
    assert "temperature 0.5" in page and "dyn://big" in page and "not placed" in page
    assert "queued prefill weight 0.25" in page


def test_a_disaggregated_pipeline_page_has_each_groups_phases_prefill_first_and_an_aggregated_one_none() -> None:
    groups = [GroupSpec(role="prefill"), GroupSpec(role="decode", replicas=2)]
    split = deploy_pipeline(TEST_ACTOR, name="split", model=make_model("split-model"), groups=groups)
    whole = deploy("whole")
    browser = logged_in(Role.READ_ONLY)
    page = browser.get(f"/pipelines/{split.pk}/").content.decode()
    prefill, decode = (split.groups.get(role=role).pk for role in ("prefill", "decode"))
    assert "<h2>Phases</h2>" in page
    assert page.index(f'<div id="phases-{prefill}"') < page.index(f'<div id="phases-{decode}"')
    assert page.count("nothing counted yet") == 2  # until the bridge pushes the first figures
    assert "<h2>Phases</h2>" not in browser.get(f"/pipelines/{whole.pk}/").content.decode()


def test_an_unknown_pipeline_is_a_404_and_a_huge_id_is_too() -> None:
    browser = logged_in(Role.READ_ONLY)
    assert browser.get("/pipelines/999/").status_code == 404
    assert browser.get("/pipelines/99999999999999999999999/").status_code == 404
