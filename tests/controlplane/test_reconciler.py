"""Reconciler passes, with a recording Dispatcher: what is sent to which node's queue, and when."""

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.deployments import actions as deployment_actions
from controlplane.deployments.dispatch import DispatchError
from controlplane.deployments.reconciler import LEASE_NAME, ReconcilerSettings
from controlplane.fleet import actions as fleet_actions
from controlplane.fleet.models import Instance, InstanceState, Lease, Node
from runtime.fencing import FENCES_PREFIX, fence_key
from runtime.fleet_tasks import TASK_START_INSTANCE, TASK_STOP_INSTANCE, HubSource, StartInstance, StopInstance
from tests.controlplane.factories import TEST_ACTOR, GiB, deploy, make_model, make_node
from tests.controlplane.reconciling import Clock, RecordingDispatcher, agent_reports, make_reconciler
from tests.distributed.cluster import etcd_values
from tests.infra import EtcdServer
from tests.servers import free_port

pytestmark = pytest.mark.django_db
S = InstanceState
START, STOP = TASK_START_INSTANCE, TASK_STOP_INSTANCE
HOUR = 3600  # a node timeout for tests that move the clock but are not about silent nodes


@pytest.fixture
def dispatcher() -> RecordingDispatcher:
    return RecordingDispatcher()


@pytest.fixture
def clock() -> Clock:
    return Clock()


def instances(pipeline_name: str) -> list[Instance]:
    return list(Instance.objects.select_related("node").filter(pipeline__name=pipeline_name).order_by("replica"))


def test_a_pass_places_new_instances_and_sends_each_one_start(dispatcher: RecordingDispatcher, clock: Clock) -> None:
    make_node("gpu-a", (80, 80))
    deploy("chat", replicas=2, gpus_per_replica=1, router_mode="kv")
    reconciler = make_reconciler(dispatcher, clock)

    report = reconciler.run_once()

    first, second = instances("chat")
    assert report is not None and (report.placed, report.started) == (2, 2)
    assert dispatcher.take() == [("node.gpu-a", START, first.pk), ("node.gpu-a", START, second.pk)]
    assert first.state == S.PENDING and first.dispatched_at is not None
    assert AuditEntry.objects.filter(action="instance.dispatch", actor_name="system:reconciler").count() == 2
    reconciler.run_once()
    assert dispatcher.take() == []  # nothing new: nothing sent twice


def test_the_start_message_describes_the_worker(dispatcher: RecordingDispatcher, clock: Clock) -> None:
    make_node("gpu-a", (80, 80))
    model = make_model("smol", memory_bytes=10 * GiB, default_engine_args={"speedup_ratio": 10})
    deploy("org/chat", model, gpus_per_replica=1, router_mode="kv")
    make_reconciler(dispatcher, clock).run_once()

    [sent] = dispatcher.sent
    assert isinstance(sent.message, StartInstance)
    spec = sent.message.spec
    assert (spec.pipeline, spec.group, spec.replica, spec.engine) == ("org-chat", "aggregated", 0, "mocker")
    assert (spec.model_name, spec.component, spec.endpoint) == ("org/chat", "backend", "generate")
    assert (spec.gpu_indexes, spec.gpu_memory_bytes) == ([0], 10 * GiB)
    assert spec.engine_args == ["--extra-engine-args", '{"speedup_ratio":10}']
    assert spec.router is not None and spec.router.mode == "kv"
    assert sent.message.source == HubSource(repo_id="HuggingFaceTB/SmolLM2-135M-Instruct", revision="main")
    assert sent.message.attempt == 0
    assert sent.expires_s == ReconcilerSettings().resend_after_s


def test_an_unanswered_start_is_sent_again_after_the_resend_timeout(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    make_node("gpu-a", (80,))
    deploy("chat", gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock, resend_after_s=30, node_timeout_s=HOUR)
    reconciler.run_once()
    [instance] = instances("chat")
    assert dispatcher.take() == [("node.gpu-a", START, instance.pk)]

    clock.advance(29)
    reconciler.run_once()
    assert dispatcher.take() == []
    clock.advance(2)
    reconciler.run_once()
    assert dispatcher.take() == [("node.gpu-a", START, instance.pk)]

    agent_reports(instance, S.DOWNLOADING)  # the agent has it now: no more resends
    clock.advance(60)
    reconciler.run_once()
    assert dispatcher.take() == []


def test_scaling_down_sends_a_stop_to_the_instances_node(dispatcher: RecordingDispatcher, clock: Clock) -> None:
    make_node("gpu-a", (80, 80))
    pipeline = deploy("chat", replicas=2, gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock)
    reconciler.run_once()
    for instance in instances("chat"):
        agent_reports(instance, S.READY)
    dispatcher.take()

    deployment_actions.scale_pipeline(TEST_ACTOR, pipeline, 1)
    report = reconciler.run_once()

    kept, stopped = instances("chat")
    assert report is not None and report.stopped == 1
    assert dispatcher.take() == [("node.gpu-a", STOP, stopped.pk)]
    assert (kept.state, stopped.state) == (S.READY, S.STOPPING)


def test_a_stop_message_carries_the_reason_and_the_grace(dispatcher: RecordingDispatcher, clock: Clock) -> None:
    make_node("gpu-a", (80,))
    pipeline = deploy("chat", gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock, stop_grace_s=12)
    reconciler.run_once()
    agent_reports(instances("chat")[0], S.READY)
    dispatcher.sent.clear()

    deployment_actions.stop_pipeline(TEST_ACTOR, pipeline)
    reconciler.run_once()

    [sent] = dispatcher.sent
    assert isinstance(sent.message, StopInstance)
    assert sent.message.reason == "pipeline stopped by system:tests"
    assert sent.message.grace_s == 12


def test_a_failed_instance_is_restarted_after_its_backoff_and_started_again(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    make_node("gpu-a", (80,))
    deploy("chat", gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock)
    reconciler.run_once()
    [instance] = instances("chat")
    agent_reports(instance, S.READY)
    agent_reports(instance, S.FAILED, "exit code 1: CUDA out of memory")
    clock.catch_up()
    dispatcher.take()

    clock.advance(0.9)  # the first failure waits 1 s
    reconciler.run_once()
    instance.refresh_from_db()
    assert (instance.state, instance.failure_streak) == (S.FAILED, 1)

    clock.advance(0.1)
    report = reconciler.run_once()
    instance.refresh_from_db()
    assert report is not None and (report.restarted, report.placed, report.started) == (1, 1, 1)
    assert (instance.state, instance.restarts, instance.reason) == (S.PENDING, 1, "")
    [sent] = dispatcher.sent
    assert isinstance(sent.message, StartInstance) and sent.message.attempt == 1
    restart = AuditEntry.objects.get(action="instance.restart")
    assert restart.before["reason"] == "exit code 1: CUDA out of memory"


def test_the_backoff_doubles_with_each_failure_in_a_row_up_to_its_cap() -> None:
    settings = ReconcilerSettings(backoff_max_s=60)
    assert [settings.backoff_s(streak) for streak in range(9)] == [0, 1, 2, 4, 8, 16, 32, 60, 60]


def test_an_instance_that_keeps_failing_is_given_up_after_max_restarts(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    make_node("gpu-a", (80,))
    deploy("chat", gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock, max_restarts=2, node_timeout_s=HOUR)
    reconciler.run_once()
    [instance] = instances("chat")
    for _ in range(3):
        agent_reports(instance, S.FAILED, "exit code 2: unknown flag --speedup")
        clock.advance(60)
        reconciler.run_once()

    instance.refresh_from_db()
    assert (instance.state, instance.restarts) == (S.FAILED, 2)
    assert instance.reason == "gave up after 2 restarts: exit code 2: unknown flag --speedup"
    assert AuditEntry.objects.filter(action="instance.give_up").count() == 1
    dispatcher.take()
    clock.advance(600)
    reconciler.run_once()
    assert dispatcher.take() == []

    fleet_actions.restart_instance(TEST_ACTOR, instance)  # a person's restart revives it
    reconciler.run_once()
    instance.refresh_from_db()
    assert (instance.state, instance.failure_streak) == (S.PENDING, 0)
    assert dispatcher.take() == [("node.gpu-a", START, instance.pk)]


def test_a_failure_after_a_long_healthy_run_starts_a_new_streak(dispatcher: RecordingDispatcher, clock: Clock) -> None:
    make_node("gpu-a", (80,))
    deploy("chat", gpus_per_replica=1)
    make_reconciler(dispatcher, clock).run_once()
    [instance] = instances("chat")
    Instance.objects.filter(pk=instance.pk).update(failure_streak=5)
    agent_reports(instance, S.READY)
    Instance.objects.filter(pk=instance.pk).update(state_changed_at=timezone.now() - timedelta(minutes=11))

    instance = agent_reports(instance, S.FAILED, "killed by signal 9")

    assert instance.failure_streak == 1


def test_a_silent_node_goes_offline_and_its_instances_are_placed_on_the_other_node(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    make_node("gpu-a", (80,))
    make_node("gpu-b", (80, 80))
    deploy("chat", replicas=2, gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock, node_timeout_s=15)
    reconciler.run_once()
    on_a, on_b = sorted(instances("chat"), key=lambda i: i.node.name)  # type: ignore[union-attr]
    assert (on_a.node.name, on_b.node.name) == ("gpu-a", "gpu-b")  # type: ignore[union-attr]
    agent_reports(on_a, S.READY)
    agent_reports(on_b, S.READY)
    dispatcher.take()

    clock.advance(16)  # gpu-b heartbeats on; gpu-a is silent
    Node.objects.filter(name="gpu-b").update(last_heartbeat_at=clock.now)
    report = reconciler.run_once()

    assert report is not None and report.nodes_offline == ["gpu-a"]
    assert Node.objects.get(name="gpu-a").state == Node.State.OFFLINE
    on_a.refresh_from_db()
    assert (on_a.state, on_a.node.name, on_a.restarts) == (S.PENDING, "gpu-b", 1)  # type: ignore[union-attr]
    assert dispatcher.take() == [("node.gpu-b", START, on_a.pk)]
    lost = AuditEntry.objects.get(action="instance.node_lost")
    assert lost.after["state"] == S.FAILED
    assert lost.after["reason"].startswith("node gpu-a stopped heartbeating at ")
    assert AuditEntry.objects.filter(action="node.offline", target_name="gpu-a").exists()


def _lose_node_a(dispatcher: RecordingDispatcher, clock: Clock, **settings: Any) -> tuple[Instance, Instance]:
    """Two ready replicas, one on gpu-a (worker 0xa1) and one on gpu-b (0xb1); then gpu-a falls silent."""
    make_node("gpu-a", (80,))
    make_node("gpu-b", (80, 80))
    deploy("chat", replicas=2, gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock, node_timeout_s=15, **settings)
    reconciler.run_once()
    on_a, on_b = sorted(instances("chat"), key=lambda i: i.node.name)  # type: ignore[union-attr]
    agent_reports(on_a, S.READY, worker_id=0xA1)
    agent_reports(on_b, S.READY, worker_id=0xB1)
    clock.advance(16)
    Node.objects.filter(name="gpu-b").update(last_heartbeat_at=clock.now)
    report = reconciler.run_once()
    assert report is not None and report.nodes_offline == ["gpu-a"]
    return on_a, on_b


def test_the_workers_of_a_lost_node_are_fenced_in_etcd(
    etcd_server: EtcdServer,  # first: the clock starts once etcd (~1 s to start) is up
    dispatcher: RecordingDispatcher,
    clock: Clock,
) -> None:
    _lose_node_a(dispatcher, clock, etcd_endpoints=(etcd_server.endpoint,))

    fences = etcd_values(etcd_server, FENCES_PREFIX)
    assert list(fences) == [fence_key(0xA1)]  # the replica on gpu-b is not touched
    assert fences[fence_key(0xA1)].startswith("node gpu-a stopped heartbeating")


def test_without_etcd_the_lost_workers_cannot_be_fenced_and_the_log_says_so(
    dispatcher: RecordingDispatcher, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    on_a, _ = _lose_node_a(dispatcher, clock)

    assert "cannot fence the workers of offline node gpu-a (a1): ETCD_ENDPOINTS is not set" in caplog.text
    on_a.refresh_from_db()
    assert on_a.node is not None and on_a.node.name == "gpu-b"  # placed elsewhere all the same


def test_an_unreachable_etcd_is_logged_and_the_lost_instances_are_placed_all_the_same(
    dispatcher: RecordingDispatcher, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    on_a, _ = _lose_node_a(dispatcher, clock, etcd_endpoints=(f"http://127.0.0.1:{free_port()}",))

    assert "cannot reach etcd to fence workers" in caplog.text
    on_a.refresh_from_db()
    assert on_a.node is not None and on_a.node.name == "gpu-b"


def test_a_stopping_instance_on_a_lost_node_is_stopped(dispatcher: RecordingDispatcher, clock: Clock) -> None:
    make_node("gpu-a", (80,))
    pipeline = deploy("chat", gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock, node_timeout_s=15)
    reconciler.run_once()
    deployment_actions.stop_pipeline(TEST_ACTOR, pipeline)

    clock.advance(16)
    reconciler.run_once()

    [instance] = instances("chat")
    assert instance.state == S.STOPPED
    assert instance.reason.endswith("while it was stopping")


def test_a_heartbeat_that_arrives_in_time_keeps_the_node_online(dispatcher: RecordingDispatcher, clock: Clock) -> None:
    make_node("gpu-a", (80,))
    reconciler = make_reconciler(dispatcher, clock, node_timeout_s=15)
    clock.advance(14)
    reconciler.run_once()
    assert Node.objects.get().state == Node.State.ONLINE


def test_draining_stops_the_instances_there_and_starts_replacements_elsewhere(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    node_a = make_node("gpu-a", (80,))
    make_node("gpu-b", (80,))
    deploy("chat", gpus_per_replica=1, pinned_nodes=[])
    reconciler = make_reconciler(dispatcher, clock)
    reconciler.run_once()
    [old] = instances("chat")
    assert old.node == node_a
    agent_reports(old, S.READY)
    dispatcher.take()

    fleet_actions.drain_node(TEST_ACTOR, node_a)
    reconciler.run_once()

    old_now, replacement = instances("chat")
    assert old_now.state == S.STOPPING
    assert replacement.node is not None and replacement.node.name == "gpu-b"
    assert dispatcher.take() == [("node.gpu-a", STOP, old.pk), ("node.gpu-b", START, replacement.pk)]


def test_an_unplaceable_pipeline_keeps_its_reason_and_nothing_is_sent(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    make_node("gpu-a", (24,))
    deploy("big", make_model("big", memory_bytes=40 * GiB), gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock)

    report = reconciler.run_once()
    reconciler.run_once()

    [instance] = instances("big")
    assert report is not None and (report.placed, report.unplaceable) == (0, 1)
    assert instance.node is None
    assert instance.reason.startswith("needs 1 GPU with 40 GiB free; the best node, gpu-a, has 0")
    assert dispatcher.take() == []
    assert AuditEntry.objects.filter(action="instance.unschedulable").count() == 1


def test_a_restart_in_place_stops_then_starts_on_the_same_node(dispatcher: RecordingDispatcher, clock: Clock) -> None:
    make_node("gpu-a", (80,))
    deploy("chat", gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock)
    reconciler.run_once()
    [instance] = instances("chat")
    agent_reports(instance, S.READY)
    dispatcher.take()

    fleet_actions.restart_instance(TEST_ACTOR, instance)
    reconciler.run_once()
    assert dispatcher.take() == [("node.gpu-a", STOP, instance.pk)]
    agent_reports(instance, S.STOPPED)
    reconciler.run_once()

    [sent] = dispatcher.sent
    assert sent.queue == "node.gpu-a"
    assert isinstance(sent.message, StartInstance) and sent.message.attempt == 1


def test_a_pass_that_finds_another_running_sends_nothing_and_asks_it_to_run_again(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    make_node("gpu-a", (80,))
    deploy("chat", gpus_per_replica=1)
    Lease.acquire(LEASE_NAME, "another-pass", clock(), timedelta(seconds=30))

    assert make_reconciler(dispatcher, clock).run_once() is None

    assert dispatcher.take() == []
    assert Lease.objects.get(name=LEASE_NAME).rerun_requested
    clock.advance(31)  # the other pass died: its lease runs out
    assert make_reconciler(dispatcher, clock, node_timeout_s=HOUR).run_once() is not None
    assert len(dispatcher.take()) == 1


def test_a_pass_asked_for_during_a_pass_runs_right_after_it(dispatcher: RecordingDispatcher, clock: Clock) -> None:
    make_node("gpu-a", (80, 80))
    deploy("first", gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock)

    def deploy_and_ask_for_a_pass() -> None:
        deploy("second", gpus_per_replica=1)
        assert make_reconciler(dispatcher, clock).run_once() is None  # the lease is taken

    dispatcher.on_send = deploy_and_ask_for_a_pass
    reconciler.run_once()

    [first], [second] = instances("first"), instances("second")
    assert dispatcher.take() == [("node.gpu-a", START, first.pk), ("node.gpu-a", START, second.pk)]
    assert Lease.objects.get(name=LEASE_NAME).holder == ""


def test_two_passes_at_once_send_each_task_once(dispatcher: RecordingDispatcher, clock: Clock) -> None:
    make_node("gpu-a", (80, 80, 80))
    deploy("chat", replicas=3, gpus_per_replica=1)
    outer = make_reconciler(dispatcher, clock)
    inner = make_reconciler(dispatcher, clock)
    # The second pass runs whole while the first is between reading what is due and sending it: as if
    # the lease had expired under a slow pass.
    dispatcher.on_send = lambda: inner.reconcile()

    outer.reconcile()

    sent = dispatcher.take()
    assert sorted(instance_id for _, _, instance_id in sent) == [i.pk for i in instances("chat")]
    assert AuditEntry.objects.filter(action="instance.dispatch").count() == 3


def test_a_broker_failure_sends_nothing_records_nothing_and_the_next_pass_retries(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    make_node("gpu-a", (80, 80))
    deploy("chat", replicas=2, gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock)
    dispatcher.failure = DispatchError("the broker redis://127.0.0.1:6379/0 did not take it")

    report = reconciler.run_once()

    assert report is not None and report.started == 0
    assert "did not take it" in report.dispatch_error
    assert all(instance.dispatched_at is None for instance in instances("chat"))
    assert not AuditEntry.objects.filter(action="instance.dispatch").exists()
    dispatcher.failure = None
    reconciler.run_once()
    assert len(dispatcher.take()) == 2


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_NODE_TIMEOUT_S", "30")
    monkeypatch.setenv("FLOTILLA_MAX_RESTARTS", "3")
    settings = ReconcilerSettings.from_env()
    assert (settings.node_timeout_s, settings.max_restarts, settings.interval_s) == (30, 3, 2)


def test_a_malformed_setting_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_MAX_RESTARTS", "many")
    with pytest.raises(Exception, match="FLOTILLA_MAX_RESTARTS='many' is not an integer"):
        ReconcilerSettings.from_env()
