"""An instance's page: its placement decision and why, its timeline, its replica's restart history, its engine
settings, its load, and its log followed with a filter; for every role, a 404 for an unknown instance."""

import pytest

from controlplane.accounts.models import Role
from controlplane.dashboard import partials
from controlplane.deployments import instances as instance_actions
from controlplane.deployments.instance_events import KEEP_EVENTS, record_event
from controlplane.deployments.instance_states import InstanceState
from controlplane.deployments.models import Instance, InstanceEvent
from controlplane.deployments.upkeep import place_pending_instances
from controlplane.fleet import actions as fleet_actions
from controlplane.fleet.models import Node
from runtime.fleet_contract.reports import InstanceReport
from runtime.fleet_contract.tasks import TASK_START_INSTANCE
from tests.controlplane.factories import TEST_ACTOR, deploy, make_model, make_node, placed_instance, run_instance
from tests.controlplane.reconciling import Clock, RecordingDispatcher, agent_reports, make_reconciler
from tests.controlplane.test_dashboard import logged_in

pytestmark = pytest.mark.django_db
S = InstanceState
GiB = 1 << 30


def page(instance: Instance, role: Role = Role.READ_ONLY) -> str:
    response = logged_in(role).get(f"/instances/{instance.pk}/")
    assert response.status_code == 200
    return response.content.decode()


def test_a_placed_instance_shows_where_it_went_and_why_each_other_node_was_passed_over() -> None:
    make_node("gpu-a", (80,))
    make_node("gpu-b", (80,))
    make_node("gpu-c", (8,))
    fleet_actions.cordon_node(TEST_ACTOR, Node.objects.get(name="gpu-b"))
    deploy("chat", model=make_model("chat-model", memory_bytes=20 * GiB), gpus_per_replica=1)
    place_pending_instances(TEST_ACTOR)

    instance = Instance.objects.get()
    candidates = {row["node"]: row for row in instance.placement["candidates"]}
    assert (instance.placement["node"], instance.placement["gpus"]) == ("gpu-a", [0])
    assert candidates["gpu-a"]["chosen"] is True
    assert candidates["gpu-b"]["why"] == "cordoned: takes no new instances"
    assert candidates["gpu-c"]["why"].startswith("not enough free GPU memory: 0 of its GPUs have 20 GiB free")
    html = page(instance)
    assert "Placed on <strong>gpu-a</strong>, GPUs #0: it needed 1 GPU with 20 GiB free each" in html
    assert "cordoned: takes no new instances" in html
    assert "(the freest has 8 GiB)" in html


def test_an_unschedulable_instance_shows_why_no_node_fits() -> None:
    make_node("gpu-a", (8,))
    deploy("chat", model=make_model("chat-model", memory_bytes=20 * GiB), gpus_per_replica=1)
    place_pending_instances(TEST_ACTOR)

    instance = Instance.objects.get()
    assert instance.node is None and instance.placement["node"] is None
    html = page(instance)
    assert "No node fits: needs 1 GPU with 20 GiB free; the best node, gpu-a, has 0" in html
    assert "not enough free GPU memory" in html
    assert [event.kind for event in instance.events.all()] == ["state", "unschedulable"]


def test_a_cpu_instance_on_a_node_with_fewer_cpus_warns_of_the_sharing() -> None:
    make_node("cpu-a", ())  # 8 CPUs (the factory's report)
    deploy("tiny", replicas=9)
    place_pending_instances(TEST_ACTOR)

    last = Instance.objects.order_by("replica").last()
    assert last is not None
    assert last.placement["cpu"] == {"instances": 9, "cpus": 8}
    assert "cpu-a: 9 CPU instances on 8 CPUs: they share them" in page(last)


def test_every_state_change_and_dispatch_is_a_row_of_the_timeline() -> None:
    dispatcher, clock = RecordingDispatcher(), Clock()
    make_node("gpu-a", (80,))
    deploy("chat", gpus_per_replica=1)
    make_reconciler(dispatcher, clock).run_once()
    instance = Instance.objects.get()
    agent_reports(instance, S.DOWNLOADING)
    instance_actions.report_instance_state(
        TEST_ACTOR, "gpu-a", instance.pk, InstanceReport(state=S.DOWNLOADING, download_progress=0.6)
    )
    agent_reports(instance, S.READY, worker_id=0xABC)
    agent_reports(instance, S.FAILED, "the worker failed with exit code 137")

    events = list(instance.events.order_by("at", "id").values_list("kind", "before", "after", "message"))
    assert events[:3] == [
        ("state", "", "pending", "created"),
        ("placed", "", "", "placed on gpu-a GPUs 0"),
        ("dispatch", "", "", "start sent to gpu-a (send 1)"),
    ]
    assert events[3:] == [
        ("state", "pending", "downloading", ""),
        ("download", "", "", "downloaded 50% of the model"),
        ("state", "downloading", "ready", ""),
        ("state", "ready", "failed", "the worker failed with exit code 137"),
    ]
    html = page(instance)
    assert "ready → failed" in html and "(exit code 137)" in html


def test_the_timeline_keeps_the_latest_events_only() -> None:
    instance = placed_instance()
    for number in range(KEEP_EVENTS + 5):
        record_event(instance, InstanceEvent.Kind.DOWNLOAD, f"event {number}")
    messages = list(instance.events.order_by("at", "id").values_list("message", flat=True))
    assert len(messages) == KEEP_EVENTS
    assert messages[-1] == f"event {KEEP_EVENTS + 4}"


def test_a_replica_restarted_twice_lists_both_restarts_with_why_and_exit_code() -> None:
    make_node("gpu-a", (80,))
    deploy("chat", replicas=2, gpus_per_replica=1)
    place_pending_instances(TEST_ACTOR)
    instance = Instance.objects.select_related("node", "pipeline", "group").order_by("replica").first()
    assert instance is not None
    run_instance(instance)
    agent_reports(instance, S.FAILED, "the worker failed with exit code 3")
    instance.refresh_from_db()
    instance_actions.restart_instance(TEST_ACTOR, instance)  # failed → pending
    place_pending_instances(TEST_ACTOR)
    instance.refresh_from_db()
    run_instance(instance)
    instance_actions.restart_instance(TEST_ACTOR, instance)  # ready → stopping, then pending when stopped
    agent_reports(instance, S.STOPPED)

    instance.refresh_from_db()
    assert instance.replica_restarts == 2
    html = page(instance)
    restarts = html.split('aria-label="restarts"')[1].split('aria-label="timeline"')[0]
    assert restarts.count('class="tr restart"') == 2
    assert "the worker failed with exit code 3" in restarts and "exit code 3</div>" in restarts
    assert f"restart by {TEST_ACTOR.name}" in restarts


def test_a_restart_in_a_new_row_is_in_the_history_of_the_replica() -> None:
    make_node("gpu-a", (80, 80))
    deploy("chat", gpus_per_replica=1)
    place_pending_instances(TEST_ACTOR)
    instance = run_instance(Instance.objects.select_related("node", "pipeline", "group").get())
    instance_actions.restart_instance(TEST_ACTOR, instance)  # the only replica: a replacement starts beside it

    replacement = Instance.objects.exclude(pk=instance.pk).get()
    assert replacement.previous_id == instance.pk
    html = page(replacement)
    assert f"(the replica ran as {instance.name} before)" in html
    assert "<dt>Restarts</dt><dd>1 " in html


def test_the_engine_settings_are_those_the_start_sent() -> None:
    dispatcher, clock = RecordingDispatcher(), Clock()
    make_node("gpu-a", (80,))
    pipeline = deploy("chat", gpus_per_replica=1, router_mode="kv")
    pipeline.groups.update(engine_args={"max_num_seqs": 8})
    make_reconciler(dispatcher, clock).run_once()
    [sent] = [sent for sent in dispatcher.sent if sent.task == TASK_START_INSTANCE]

    html = page(Instance.objects.get())
    assert "As sent with its start at" in html
    assert "<dt>Engine</dt><dd>mocker</dd>" in html
    assert "<code>--extra-engine-args &#x27;{&quot;max_num_seqs&quot;:8}&#x27;</code>" in html  # the mocker's file
    assert "mode kv" in html
    assert f"&quot;instance_id&quot;: {sent.message.spec.instance_id}" in html  # type: ignore[union-attr]


def test_an_unplaced_instance_has_no_engine_settings_yet() -> None:
    deploy("chat")
    assert "None: not placed on a node yet: its settings are sent with its start." in page(Instance.objects.get())


def test_the_page_has_the_load_panel_and_follows_the_pipelines_socket() -> None:
    instance = placed_instance()
    html = page(instance)
    assert f'id="load-{instance.pk}"' in html and "no load reported yet" in html
    assert f'ws-connect="/ws/instances/{instance.pk}/"' in html
    assert "every 2s[document.getElementById('log-follow').checked]" in html


def test_an_unknown_instance_is_a_404() -> None:
    assert logged_in(Role.READ_ONLY).get("/instances/12345/").status_code == 404


def test_a_person_not_logged_in_is_sent_to_log_in() -> None:
    from django.test import Client

    instance = placed_instance()
    response = Client().get(f"/instances/{instance.pk}/")
    assert response.status_code == 302 and "/login/" in response["Location"]


def test_read_only_people_see_no_controls_on_it() -> None:
    instance = run_instance(placed_instance())
    html = page(instance, Role.READ_ONLY)
    assert "hx-post" not in html.split("<main>")[1]


def test_the_pipeline_page_and_the_node_page_link_to_it() -> None:
    instance = placed_instance()
    link = f'href="/instances/{instance.pk}/"'
    browser = logged_in(Role.READ_ONLY)
    assert link in browser.get(f"/pipelines/{instance.pipeline_id}/").content.decode()
    assert link in browser.get("/nodes/").content.decode()


def test_the_live_detail_renders_the_same_partial_as_the_page() -> None:
    instance = placed_instance()
    html = partials.render_instance_detail(instance.pk)
    assert html.startswith(f'<div id="detail-{instance.pk}">')
    assert page(instance).count(f'<div id="detail-{instance.pk}">') == 1


LOG = "INFO worker starting\nERROR out of memory\nwarn: an error, in lower case\nINFO ready\n"


@pytest.fixture
def multi_line_log(log_dispatcher: RecordingDispatcher, monkeypatch: pytest.MonkeyPatch) -> RecordingDispatcher:
    """The agent's log tail answers four lines."""
    monkeypatch.setattr(log_dispatcher, "log_tail", lambda node, request, *, timeout_s: LOG)
    return log_dispatcher


def test_the_followed_log_keeps_the_lines_that_contain_the_filter_ignoring_case(
    multi_line_log: RecordingDispatcher,
) -> None:
    instance = placed_instance()
    response = logged_in(Role.READ_ONLY).get(f"/instances/{instance.pk}/log/", {"pane": "text", "grep": "Error"})
    assert response.status_code == 200
    html = response.content.decode()
    assert '<pre class="log">ERROR out of memory\nwarn: an error, in lower case\n</pre>' in html
    assert "<form" not in html  # the text alone: the page's controls stay as the person left them


def test_a_filter_no_line_matches_says_so(multi_line_log: RecordingDispatcher) -> None:
    instance = placed_instance()
    html = logged_in(Role.READ_ONLY).get(f"/instances/{instance.pk}/log/", {"pane": "text", "grep": "panic"})
    assert "No line of the last 100 contains “panic”." in html.content.decode()


@pytest.mark.parametrize(
    ("grep", "message"),
    [
        ("x" * 201, "grep: at most 200 characters, not 201"),
        ("two\nlines", "grep: text to find within one line"),
    ],
)
def test_a_bad_filter_is_a_400_with_its_reason(log_dispatcher: RecordingDispatcher, grep: str, message: str) -> None:
    instance = placed_instance()
    response = logged_in(Role.READ_ONLY).get(f"/instances/{instance.pk}/log/", {"pane": "text", "grep": grep})
    assert response.status_code == 400
    assert message in response.content.decode()
    assert log_dispatcher.sent == []  # the agent is not asked


def test_the_api_filters_the_log_the_same_way(multi_line_log: RecordingDispatcher) -> None:
    from rest_framework.test import APIClient

    from tests.controlplane.factories import make_user, person_token

    instance = placed_instance()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {person_token(make_user('reader', Role.READ_ONLY))}")
    response = client.get(f"/api/v1/instances/{instance.pk}/log/", {"grep": "ready"})
    assert response.status_code == 200
    assert response.json()["text"] == "INFO ready\n"
    refused = client.get(f"/api/v1/instances/{instance.pk}/log/", {"grep": "y" * 300})
    assert refused.status_code == 400 and "grep" in refused.content.decode()


def test_the_placement_record_stays_out_of_the_audit_log() -> None:
    from controlplane.audit.models import AuditEntry

    instance = placed_instance()
    entry = AuditEntry.objects.filter(action="instance.place", target_id=str(instance.pk)).get()
    assert isinstance(entry.after, dict) and entry.after["node"] == instance.node_id
    assert "placement" not in entry.after and instance.placement["node"] == "gpu-a"
