"""Reconciler passes, with a recording Dispatcher: what is sent to which node's queue, and when."""

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from controlplane.accounts.models import ApiToken
from controlplane.audit.models import AuditEntry
from controlplane.audit.records import Actor
from controlplane.deployments import evacuation
from controlplane.deployments import instances as instance_actions
from controlplane.deployments import pipelines as pipeline_actions
from controlplane.deployments.dispatch import DispatchError
from controlplane.deployments.instance_states import InstanceState
from controlplane.deployments.models import Instance, Lease
from controlplane.deployments.reconciler import LEASE_NAME, Reconciler, ReconcilerSettings
from controlplane.fleet import actions as fleet_actions
from controlplane.fleet.models import Node
from runtime.errors import ConfigError
from runtime.fleet_contract.fences import FENCES_PREFIX, fence_key, fence_reason
from runtime.fleet_contract.liveness import ASKED_PREFIX, asked_key, claim_value, liveness_key
from runtime.fleet_contract.signing import SigningKey, agent_signing_key
from runtime.fleet_contract.tasks import TASK_START_INSTANCE, TASK_STOP_INSTANCE, HubSource, StartInstance, StopInstance
from runtime.fleet_contract.worker_keys import WorkerKey, worker_key
from tests.controlplane.factories import TEST_ACTOR, GiB, agent_token, deploy, make_model, make_node, node_report
from tests.controlplane.reconciling import Clock, RecordingDispatcher, Sent, agent_reports, make_reconciler
from tests.distributed.cluster import etcd_leases, etcd_put, etcd_values
from tests.infra import EtcdServer
from tests.servers import free_port

pytestmark = [pytest.mark.django_db, pytest.mark.postgresql]
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


def test_the_start_message_names_the_reserved_gpus_by_the_uuids_their_node_reported(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    fleet_actions.register_node(
        Actor.agent("gpu-a"), "gpu-a", node_report((80, 80, 80), uuids=("GPU-aaaa", "GPU-bbbb", "GPU-cccc"))
    )
    make_node("gpu-b", (80, 80))  # an agent that says no UUIDs: its GPUs are named by index only
    deploy("chat", gpus_per_replica=2, replicas=2)
    make_reconciler(dispatcher, clock).run_once()

    starts = [sent.message for sent in dispatcher.sent if isinstance(sent.message, StartInstance)]
    specs = {start.node: start.spec for start in starts}
    by_uuid = dict(zip(["GPU-aaaa", "GPU-bbbb", "GPU-cccc"], range(3), strict=True))
    assert [by_uuid[uuid] for uuid in specs["gpu-a"].gpu_uuids] == specs["gpu-a"].gpu_indexes
    assert len(specs["gpu-a"].gpu_indexes) == 2
    assert (len(specs["gpu-b"].gpu_indexes), specs["gpu-b"].gpu_uuids) == (2, [])


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

    pipeline_actions.scale_pipeline(TEST_ACTOR, pipeline, 1)
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

    pipeline_actions.stop_pipeline(TEST_ACTOR, pipeline)
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
    assert instance.reason == "gave up after 2 restarts on node gpu-a: exit code 2: unknown flag --speedup"
    assert instance.gave_up and instance.node is None
    assert AuditEntry.objects.filter(action="instance.give_up").count() == 1
    dispatcher.take()
    clock.advance(600)
    reconciler.run_once()
    assert dispatcher.take() == []

    instance_actions.restart_instance(TEST_ACTOR, instance)  # a person's restart revives it
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


def _two_ready_replicas(dispatcher: RecordingDispatcher, clock: Clock, **settings: Any) -> tuple[Instance, Instance]:
    """Two ready replicas of "chat", one on gpu-a (worker 0xa1) and one on gpu-b (0xb1)."""
    make_node("gpu-a", (80,))
    make_node("gpu-b", (80, 80))
    deploy("chat", replicas=2, gpus_per_replica=1)
    make_reconciler(dispatcher, clock, **settings).run_once()
    on_a, on_b = sorted(instances("chat"), key=lambda i: i.node.name)  # type: ignore[union-attr]
    assert (on_a.node.name, on_b.node.name) == ("gpu-a", "gpu-b")  # type: ignore[union-attr]
    agent_reports(on_a, S.READY, worker_id=0xA1)
    agent_reports(on_b, S.READY, worker_id=0xB1)
    dispatcher.take()
    return on_a, on_b


def _only_b_heartbeats(clock: Clock, seconds: float) -> None:
    clock.advance(seconds)
    Node.objects.filter(name="gpu-b").update(last_heartbeat_at=clock.now)


def test_a_silent_node_goes_offline_but_keeps_its_instances_until_its_eviction_time(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    on_a, _ = _two_ready_replicas(dispatcher, clock)
    reconciler = make_reconciler(dispatcher, clock, node_timeout_s=15, evict_after_s=300)

    _only_b_heartbeats(clock, 16)
    report = reconciler.run_once()

    assert report is not None and report.nodes_offline == ["gpu-a"]
    assert Node.objects.get(name="gpu-a").state == Node.State.OFFLINE
    on_a.refresh_from_db()
    assert (on_a.state, on_a.node.name, on_a.restarts) == (S.READY, "gpu-a", 0)  # type: ignore[union-attr]
    assert dispatcher.take() == []
    assert AuditEntry.objects.filter(action="node.offline", target_name="gpu-a").exists()

    _only_b_heartbeats(clock, 280)  # 296 s of silence: still not evicted
    reconciler.run_once()
    on_a.refresh_from_db()
    assert (on_a.state, on_a.restarts) == (S.READY, 0)

    _only_b_heartbeats(clock, 5)  # 301 s
    report = reconciler.run_once()

    assert report is not None and report.instances_lost == 1
    on_a.refresh_from_db()
    assert (on_a.state, on_a.node.name, on_a.restarts) == (S.PENDING, "gpu-b", 1)  # type: ignore[union-attr]
    assert dispatcher.take() == [("node.gpu-b", START, on_a.pk)]
    lost = AuditEntry.objects.get(action="instance.node_lost")
    assert lost.after["state"] == S.FAILED
    assert lost.after["reason"].startswith("node gpu-a stopped heartbeating at ")


def test_a_node_that_comes_back_before_its_eviction_time_loses_nothing(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    on_a, on_b = _two_ready_replicas(dispatcher, clock)
    reconciler = make_reconciler(dispatcher, clock, node_timeout_s=15, evict_after_s=300)
    _only_b_heartbeats(clock, 60)
    reconciler.run_once()
    assert Node.objects.get(name="gpu-a").state == Node.State.OFFLINE

    fleet_actions.heartbeat(Actor.agent("gpu-a"), "gpu-a", node_report((80,)))
    Node.objects.update(last_heartbeat_at=clock.now)  # the clock is ahead of the real time the action stamped
    report = reconciler.run_once()

    assert report is not None and not report.changed
    assert Node.objects.get(name="gpu-a").state == Node.State.ONLINE
    for before in (on_a, on_b):
        after = Instance.objects.get(pk=before.pk)
        assert (after.state, after.node_id, after.restarts, after.pid) == (S.READY, before.node_id, 0, 4242)
    assert dispatcher.take() == []


def test_when_most_of_the_fleet_falls_silent_at_once_nothing_is_evicted(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    """The control plane's own outage (a slow migration on upgrade, its network): every heartbeat stops."""
    make_node("gpu-a", (80,))
    make_node("gpu-b", (80,))
    make_node("gpu-c", (80,))
    deploy("chat", replicas=3, gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock, node_timeout_s=15, evict_after_s=60)
    reconciler.run_once()
    for instance in instances("chat"):
        agent_reports(instance, S.READY, worker_id=0xC0 + instance.replica)
    dispatcher.take()
    _only_b_heartbeats(clock, 600)  # gpu-b alone still heartbeats: 2 of 3 nodes are silent

    report = reconciler.run_once()

    assert report is not None and report.nodes_offline == ["gpu-a", "gpu-c"]
    assert report.instances_lost == 0
    assert report.evictions_held.startswith("2 of the 3 nodes that run or could take instances are silent at once (67%")
    assert [(i.state, i.restarts) for i in instances("chat")] == [(S.READY, 0)] * 3
    assert dispatcher.take() == []
    assert not AuditEntry.objects.filter(action="instance.node_lost").exists()


def _ready_fleet(dispatcher: RecordingDispatcher, clock: Clock, nodes: list[str], **settings: Any) -> Reconciler:
    """A replica ready on each of ``nodes`` (one GPU each), and the reconciler that placed them."""
    for name in nodes:
        make_node(name, (80,))
    deploy("chat", replicas=len(nodes), gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock, node_timeout_s=15, evict_after_s=60, **settings)
    reconciler.run_once()
    for instance in instances("chat"):
        agent_reports(instance, S.READY)
    dispatcher.take()
    return reconciler


def _heartbeats_from(clock: Clock, seconds: float, names: list[str]) -> None:
    """``seconds`` pass, and then the agents of ``names`` heartbeat (which brings an offline node back)."""
    clock.advance(seconds)
    Node.objects.filter(name__in=names).update(last_heartbeat_at=clock.now, state=Node.State.ONLINE)


def test_idle_online_nodes_do_not_water_down_the_disruption_share(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    # Two GPU nodes run the fleet's replicas; three CPU nodes beside them are idle. Both GPU nodes silent is
    # every occupied node silent (100%), not 2 of 5 (40%).
    reconciler = _ready_fleet(dispatcher, clock, ["gpu-a", "gpu-b"])
    for name in ("cpu-a", "cpu-b", "cpu-c"):
        make_node(name, ())
    _heartbeats_from(clock, 600, ["cpu-a", "cpu-b", "cpu-c"])

    report = reconciler.run_once()

    assert report is not None and report.instances_lost == 0
    assert report.evictions_held.startswith("2 of the 2 nodes that run or could take instances are silent at once")
    assert [(i.state, i.restarts) for i in instances("chat")] == [(S.READY, 0)] * 2


def test_an_idle_spare_of_the_same_kind_counts_so_a_lone_busy_node_that_dies_is_evicted_onto_it(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    # One GPU node runs the replica, another GPU node stands by: the busy one silent is half the nodes that run
    # or could take GPU replicas (not all of them), so it is evicted, and its replica moves to the spare.
    reconciler = _ready_fleet(dispatcher, clock, ["gpu-a"])
    make_node("gpu-b", (80,))
    _heartbeats_from(clock, 61, ["gpu-b"])

    report = reconciler.run_once()

    assert report is not None and report.instances_lost == 1 and not report.evictions_held
    [moved] = instances("chat")
    assert moved.node is not None and moved.node.name == "gpu-b"


def test_when_a_disruption_ends_the_nodes_still_silent_get_a_whole_eviction_time_from_then(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    # A 10-minute outage of the control plane: every node silent, evictions held. Then two of the three
    # agents are back; the third, still reconnecting, is not evicted in the same pass.
    reconciler = _ready_fleet(dispatcher, clock, ["gpu-a", "gpu-b", "gpu-c"])
    clock.advance(600)
    report = reconciler.run_once()
    assert report is not None and report.evictions_held.startswith("3 of the 3")

    _heartbeats_from(clock, 2, ["gpu-a", "gpu-b"])
    report = reconciler.run_once()
    assert report is not None and report.instances_lost == 0 and not report.evictions_held
    _heartbeats_from(clock, 57, ["gpu-a", "gpu-b"])  # 59 s since the disruption ended
    report = reconciler.run_once()
    assert report is not None and report.instances_lost == 0

    _heartbeats_from(clock, 2, ["gpu-a", "gpu-b"])  # 61 s: gpu-c has been silent a whole eviction time since
    report = reconciler.run_once()
    assert report is not None and report.instances_lost == 1
    lost = AuditEntry.objects.get(action="instance.node_lost")
    assert lost.target_name == "chat-aggregated-2" and "node gpu-c stopped heartbeating" in lost.after["reason"]


def test_evictions_are_rate_limited_to_one_node_per_interval(dispatcher: RecordingDispatcher, clock: Clock) -> None:
    # Two of five occupied nodes lost at once (40%: no disruption): one is evicted now, the other after the
    # interval, so that a wrong judgement moves one node's replicas, not a fleet's.
    names = ["gpu-a", "gpu-b", "gpu-c", "gpu-d", "gpu-e"]
    reconciler = _ready_fleet(dispatcher, clock, names, eviction_interval_s=10)
    _heartbeats_from(clock, 61, names[2:])

    report = reconciler.run_once()
    assert report is not None and report.instances_lost == 1
    assert report.evictions_held == "one node evicted every 10 s (FLOTILLA_NODE_EVICTION_INTERVAL_S): gpu-b waits"
    assert Node.objects.get(name="gpu-a").evicted_at == clock.now

    _heartbeats_from(clock, 9, names[2:])
    report = reconciler.run_once()
    assert report is not None and report.instances_lost == 0
    _heartbeats_from(clock, 1, names[2:])
    report = reconciler.run_once()
    assert report is not None and report.instances_lost == 1 and not report.evictions_held


def test_a_lone_node_is_never_evicted(dispatcher: RecordingDispatcher, clock: Clock) -> None:
    make_node("gpu-a", (80,))
    deploy("chat", gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock, node_timeout_s=15, evict_after_s=60)
    reconciler.run_once()
    [instance] = instances("chat")
    agent_reports(instance, S.READY)

    clock.advance(3600)
    report = reconciler.run_once()

    assert report is not None and report.evictions_held and report.instances_lost == 0
    instance.refresh_from_db()
    assert (instance.state, instance.node.name) == (S.READY, "gpu-a")  # type: ignore[union-attr]


def _lose_node_a(dispatcher: RecordingDispatcher, clock: Clock, **settings: Any) -> tuple[Instance, Instance]:
    """Two ready replicas, one on gpu-a (worker 0xa1) and one on gpu-b (0xb1); then gpu-a falls silent past
    its eviction time."""
    on_a, on_b = _two_ready_replicas(dispatcher, clock)
    reconciler = make_reconciler(dispatcher, clock, node_timeout_s=15, evict_after_s=15, **settings)
    _only_b_heartbeats(clock, 16)
    report = reconciler.run_once()
    assert report is not None and report.nodes_offline == ["gpu-a"]
    return on_a, on_b


def test_the_workers_of_a_lost_node_are_fenced_in_etcd_signed_for_each_worker(
    etcd_server: EtcdServer,  # first: the clock starts once etcd (~1 s to start) is up
    dispatcher: RecordingDispatcher,
    clock: Clock,
) -> None:
    node_key = agent_signing_key(agent_token("gpu-a"), "gpu-a")  # what gpu-a's agent derives its workers' keys from
    on_a, _ = _lose_node_a(dispatcher, clock, etcd_endpoints=(etcd_server.endpoint,))

    fences = etcd_values(etcd_server, FENCES_PREFIX)
    assert list(fences) == [fence_key(0xA1)]  # the replica on gpu-b is not touched
    # The worker's agent gave it its instance's key: the fence verifies under it, for that worker.
    reason = fence_reason(fences[fence_key(0xA1)].encode(), 0xA1, worker_key(node_key, on_a.pk))
    assert reason.startswith("node gpu-a stopped heartbeating")


def test_the_workers_of_a_node_whose_agent_token_expired_are_fenced_with_a_signature_they_accept(
    etcd_server: EtcdServer, dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    """An expired token is refused, so its agent falls silent: its workers are the very ones to fence."""
    node_key = agent_signing_key(agent_token("gpu-a"), "gpu-a")
    ApiToken.objects.filter(node_name="gpu-a").update(expires_at=timezone.now() - timedelta(hours=1))
    on_a, _ = _lose_node_a(dispatcher, clock, etcd_endpoints=(etcd_server.endpoint,))

    fence = etcd_values(etcd_server, FENCES_PREFIX)[fence_key(0xA1)].encode()
    assert fence_reason(fence, 0xA1, worker_key(node_key, on_a.pk)).startswith("node gpu-a stopped heartbeating")


def test_without_etcd_the_lost_workers_cannot_be_fenced_and_the_log_says_so(
    dispatcher: RecordingDispatcher, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    on_a, _ = _lose_node_a(dispatcher, clock)

    assert "cannot fence the workers of offline node gpu-a (a1): ETCD_ENDPOINTS is not set" in caplog.text
    on_a.refresh_from_db()
    assert on_a.node is not None and on_a.node.name == "gpu-b"  # placed elsewhere all the same


def test_while_etcd_cannot_say_which_workers_live_no_node_is_evicted(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    on_a, _ = _lose_node_a(dispatcher, clock, etcd_endpoints=(f"http://127.0.0.1:{free_port()}",))

    on_a.refresh_from_db()
    assert (on_a.state, on_a.node.name) == (S.READY, "gpu-a")  # type: ignore[union-attr]
    assert dispatcher.take() == []


def test_a_worker_that_signs_it_is_alive_is_not_evicted_with_its_silent_node(
    etcd_server: EtcdServer,  # first: the clock starts once etcd (~1 s to start) is up
    dispatcher: RecordingDispatcher,
    clock: Clock,
) -> None:
    """A partitioned agent: the control plane hears nothing from gpu-a, but its worker signs that it is alive."""
    node_key = agent_signing_key(agent_token("gpu-a"), "gpu-a")
    on_a, _ = _two_ready_replicas(dispatcher, clock)
    starting = deploy("other", pinned_nodes=["gpu-a"])
    make_reconciler(dispatcher, clock).run_once()
    [other] = instances("other")
    agent_reports(other, S.STARTING)
    reconciler = make_reconciler(
        dispatcher, clock, node_timeout_s=15, evict_after_s=15, etcd_endpoints=(etcd_server.endpoint,)
    )

    _only_b_heartbeats(clock, 16)
    etcd_put(etcd_server, liveness_key(0xA1), claim_value(worker_key(node_key, on_a.pk), 0xA1, clock.now.timestamp()))
    report = reconciler.run_once()

    assert report is not None and (report.instances_lost, report.spared) == (1, 1)
    on_a.refresh_from_db()
    assert (on_a.state, on_a.node.name, on_a.restarts) == (S.READY, "gpu-a", 0)  # type: ignore[union-attr]
    other.refresh_from_db()  # no worker in etcd yet: lost with its node, and pinned there, so not placed again
    assert other.pipeline == starting and (other.state, other.restarts, other.node) == (S.PENDING, 1, None)
    assert etcd_values(etcd_server, FENCES_PREFIX) == {}


def test_the_workers_of_offline_nodes_only_are_asked_to_sign_that_they_are_alive(
    etcd_server: EtcdServer, dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    """Each claim is an etcd write: asked for where it may spare an instance, not from every worker for ever."""
    _two_ready_replicas(dispatcher, clock)
    reconciler = make_reconciler(
        dispatcher, clock, node_timeout_s=15, evict_after_s=300, etcd_endpoints=(etcd_server.endpoint,)
    )
    reconciler.run_once()
    assert etcd_values(etcd_server, ASKED_PREFIX) == {}  # every node heartbeats
    etcd_put(etcd_server, asked_key(0xA1), "someone else's, with no lease")

    _only_b_heartbeats(clock, 16)
    reconciler.run_once()
    assert list(etcd_values(etcd_server, ASKED_PREFIX)) == [asked_key(0xA1)]
    assert etcd_leases(etcd_server, ASKED_PREFIX)[asked_key(0xA1)] != 0  # ours: it expires unless asked again

    # gpu-a is back, gpu-b falls silent: a1 is no longer asked, b1 is.
    Node.objects.filter(name="gpu-a").update(state=Node.State.ONLINE, last_heartbeat_at=clock.now)
    clock.advance(16)
    Node.objects.filter(name="gpu-a").update(last_heartbeat_at=clock.now)
    reconciler.run_once()
    assert list(etcd_values(etcd_server, ASKED_PREFIX)) == [asked_key(0xB1)]


def _registration_only(on_a: Instance, on_b: Instance, gpu_a: SigningKey, now: float) -> tuple[str, bytes]:
    # What sufficed before claims were signed: any process can put it, under a lease it keeps alive.
    return "flotilla/instances/chat/backend/generate/a1", b"{}"


def _unsigned(on_a: Instance, on_b: Instance, gpu_a: SigningKey, now: float) -> tuple[str, bytes]:
    return liveness_key(0xA1), f'{{"at":{int(now)},"instance":{on_a.pk},"signatures":{{}},"worker":161}}'.encode()


def _signed_with_the_forgers_own_key(
    on_a: Instance, on_b: Instance, gpu_a: SigningKey, now: float
) -> tuple[str, bytes]:
    # gpu-b's worker holds its own instance's key, and names gpu-a's instance and worker with it.
    own = worker_key(agent_signing_key(agent_token("gpu-b"), "gpu-b"), on_b.pk)
    return liveness_key(0xA1), claim_value(WorkerKey(on_a.pk, own.key), 0xA1, now)


def _a_stale_genuine_claim(on_a: Instance, on_b: Instance, gpu_a: SigningKey, now: float) -> tuple[str, bytes]:
    # The worker's own claim, kept by someone else from before it died (and its lease refreshed by them).
    genuine = worker_key(gpu_a, on_a.pk)
    return liveness_key(0xA1), claim_value(genuine, 0xA1, now - 600)


def _another_workers_claim(on_a: Instance, on_b: Instance, gpu_a: SigningKey, now: float) -> tuple[str, bytes]:
    # A genuine claim of an earlier worker of the same instance, put at the key of the one that is gone.
    genuine = worker_key(gpu_a, on_a.pk)
    return liveness_key(0xA1), claim_value(genuine, 0xA0, now)


@pytest.mark.parametrize(
    ("forge", "refused"),
    [
        (_registration_only, ""),  # no claim at all: nothing to refuse
        (_unsigned, "its signature does not verify"),
        (_signed_with_the_forgers_own_key, "its signature does not verify"),
        (_a_stale_genuine_claim, "it is 60"),  # 600 or 601 s old (its date is in whole seconds)
        (_another_workers_claim, "it is signed for worker a0 of instance"),
    ],
)
def test_a_forged_liveness_claim_does_not_spare_a_silent_nodes_instance(
    etcd_server: EtcdServer,
    dispatcher: RecordingDispatcher,
    clock: Clock,
    caplog: pytest.LogCaptureFixture,
    forge: Callable[[Instance, Instance, SigningKey, float], tuple[str, bytes]],
    refused: str,
) -> None:
    """Written by a worker that runs foreign code, to keep a dead node's replica from moving."""
    caplog.set_level(logging.DEBUG, logger="controlplane.deployments.reconciler")  # each refusal, not a minute's first
    gpu_a = agent_signing_key(agent_token("gpu-a"), "gpu-a")
    on_a, on_b = _two_ready_replicas(dispatcher, clock)
    reconciler = make_reconciler(
        dispatcher, clock, node_timeout_s=15, evict_after_s=15, etcd_endpoints=(etcd_server.endpoint,)
    )
    _only_b_heartbeats(clock, 16)
    etcd_put(etcd_server, *forge(on_a, on_b, gpu_a, clock.now.timestamp()))

    report = reconciler.run_once()

    assert report is not None and (report.instances_lost, report.spared, report.fenced) == (1, 0, 1)
    on_a.refresh_from_db()
    assert (on_a.node.name, on_a.restarts) == ("gpu-b", 1)  # type: ignore[union-attr]
    if refused:
        assert (
            f"the liveness claim of worker a1 (instance {on_a.pk} on silent node gpu-a) is not believed" in caplog.text
        )
        assert refused in caplog.text


def test_a_stopping_instance_on_a_lost_node_is_stopped(dispatcher: RecordingDispatcher, clock: Clock) -> None:
    make_node("gpu-a", (80,))
    pipeline = deploy("chat", gpus_per_replica=1)
    # A fleet of one node is all silent when it is: only a share of 1 lets it be evicted.
    reconciler = make_reconciler(dispatcher, clock, node_timeout_s=15, evict_after_s=15, disruption_share=1.0)
    reconciler.run_once()
    pipeline_actions.stop_pipeline(TEST_ACTOR, pipeline)

    clock.advance(16)
    reconciler.run_once()

    [instance] = instances("chat")
    assert instance.state == S.STOPPED
    assert instance.reason.endswith("while it was stopping")


def test_a_heartbeat_that_arrives_in_time_keeps_the_node_online(dispatcher: RecordingDispatcher, clock: Clock) -> None:
    make_node("gpu-a", (80,))
    make_node("gpu-b", (80,))
    Node.objects.update(last_heartbeat_at=clock.now - timedelta(seconds=14))
    reconciler = make_reconciler(dispatcher, clock, node_timeout_s=15)

    fleet_actions.heartbeat(Actor.agent("gpu-a"), "gpu-a", node_report((80,)))  # gpu-b sends none
    clock.catch_up()
    clock.advance(10)
    report = reconciler.run_once()

    assert report is not None and report.nodes_offline == ["gpu-b"]
    assert Node.objects.get(name="gpu-a").state == Node.State.ONLINE


def test_draining_starts_replacements_elsewhere_and_stops_each_instance_once_its_replacement_is_ready(
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

    evacuation.drain_node(TEST_ACTOR, node_a)
    reconciler.run_once()

    old_now, replacement = instances("chat")
    assert old_now.state == S.READY  # serving until its replacement is
    assert replacement.node is not None and replacement.node.name == "gpu-b"
    assert dispatcher.take() == [("node.gpu-b", START, replacement.pk)]
    agent_reports(replacement, S.STARTING)
    reconciler.run_once()
    assert dispatcher.take() == []

    agent_reports(replacement, S.READY)
    report = reconciler.run_once()

    assert report is not None and report.retired == 1
    assert dispatcher.take() == [("node.gpu-a", STOP, old.pk)]
    old.refresh_from_db()
    assert (old.state, old.reason) == (S.STOPPING, f"replaced by {replacement.name} on node gpu-b")


def test_an_instance_that_fails_while_its_replacement_starts_is_stopped_not_restarted(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    node_a = make_node("gpu-a", (80,))
    make_node("gpu-b", (80,))
    deploy("chat", gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock, node_timeout_s=HOUR)
    reconciler.run_once()
    [old] = instances("chat")
    agent_reports(old, S.READY)
    evacuation.drain_node(TEST_ACTOR, node_a)
    reconciler.run_once()
    agent_reports(old, S.FAILED, "killed by signal 9")
    clock.advance(60)

    report = reconciler.run_once()

    old.refresh_from_db()
    assert report is not None and (report.retired, report.restarted) == (1, 0)
    assert (old.state, old.restarts) == (S.STOPPED, 0)
    assert [i.state for i in instances("chat")] == [S.STOPPED, S.PENDING]


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

    instance_actions.restart_instance(TEST_ACTOR, instance)
    reconciler.run_once()
    assert dispatcher.take() == [("node.gpu-a", STOP, instance.pk)]
    agent_reports(instance, S.STOPPED)
    reconciler.run_once()

    [sent] = dispatcher.sent
    assert sent.queue == "node.gpu-a"
    assert isinstance(sent.message, StartInstance) and sent.message.attempt == 1


def test_a_gpu_whose_instance_restarts_in_place_is_not_given_to_another_while_it_stops(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    # While the restarting worker stops, it still holds the GPU: another pipeline's replica placed there
    # would start on a GPU in use, and the restart would then find no room on its own.
    make_node("gpu-a", (80,))
    deploy("chat", make_model("chat", memory_bytes=60 * GiB), gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock)
    reconciler.run_once()
    [instance] = instances("chat")
    agent_reports(instance, S.READY)
    instance_actions.restart_instance(TEST_ACTOR, instance)
    deploy("other", make_model("other", memory_bytes=60 * GiB), gpus_per_replica=1)

    reconciler.run_once()

    [waiting] = instances("other")
    assert waiting.node is None and "needs 1 GPU with 60 GiB free" in waiting.reason
    agent_reports(instance, S.STOPPED)
    reconciler.run_once()
    [restarted] = instances("chat")
    assert (restarted.state, restarted.node.name) == (S.PENDING, "gpu-a")  # type: ignore[union-attr]
    assert instances("other")[0].node is None  # the restart got its GPU back; "other" still waits


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


def test_a_pass_run_whole_between_another_s_read_and_send_leaves_each_task_sent_once(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
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


@pytest.mark.django_db(transaction=True)  # no test-wide transaction: the pass's own are what is looked at
def test_a_task_is_sent_with_no_transaction_open_so_a_hung_broker_holds_no_database_lock(clock: Clock) -> None:
    # A publish to a frozen Redis waits up to its socket timeout; inside the claim's transaction it held
    # SQLite's write lock that long, and every other write (agents' heartbeats) failed "database is locked".
    make_node("gpu-a", (80, 80))
    deploy("chat", replicas=2, gpus_per_replica=1)
    in_transaction: list[bool] = []

    class Watching(RecordingDispatcher):
        def _record(self, sent: Sent) -> None:
            in_transaction.append(connection.in_atomic_block)
            super()._record(sent)

    dispatcher = Watching()
    make_reconciler(dispatcher, clock).run_once()

    assert len(dispatcher.take()) == 2 and in_transaction == [False, False]
    assert AuditEntry.objects.filter(action="instance.dispatch").count() == 2


def test_a_broker_failure_after_the_claim_gives_the_claim_back_for_the_next_pass(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    make_node("gpu-a", (80, 80))
    deploy("chat", replicas=1, gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock)
    dispatcher.failure = DispatchError("the broker redis://127.0.0.1:6379/0 did not answer within 5 s")
    reconciler.run_once()
    [instance] = instances("chat")
    assert (instance.dispatched_at, instance.dispatches) == (None, 0)
    dispatcher.failure = None
    reconciler.run_once()
    [instance] = instances("chat")
    assert instance.dispatched_at is not None and instance.dispatches == 1
    assert len(dispatcher.take()) == 1


def test_a_given_up_instance_lets_its_gpu_go_to_another_pipeline(dispatcher: RecordingDispatcher, clock: Clock) -> None:
    make_node("gpu-a", (80,))
    deploy("broken", make_model("broken", memory_bytes=60 * GiB), gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock, max_restarts=0, node_timeout_s=HOUR)
    reconciler.run_once()
    [broken] = instances("broken")
    agent_reports(broken, S.FAILED, "exit code 1: bad weights")
    reconciler.run_once()
    broken.refresh_from_db()
    assert broken.reason == "gave up after 0 restarts on node gpu-a: exit code 1: bad weights"
    assert (broken.node, broken.gpu_indexes) == (None, [])

    deploy("good", make_model("good", memory_bytes=60 * GiB), gpus_per_replica=1)
    reconciler.run_once()

    [good] = instances("good")
    assert good.node is not None and (good.node.name, good.gpu_indexes) == ("gpu-a", [0])


def test_a_start_nobody_takes_fails_after_max_dispatches_and_is_placed_again(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    """gpu-a heartbeats, but its agent does not consume its queue (a broken broker connection there)."""
    make_node("gpu-a", (80,))
    deploy("chat", gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock, resend_after_s=30, max_dispatches=3, node_timeout_s=HOUR)
    for _ in range(3):
        reconciler.run_once()
        clock.advance(31)
    [instance] = instances("chat")
    assert [task for _, task, _ in dispatcher.take()] == [START] * 3

    report = reconciler.run_once()

    assert report is not None and report.overdue == 1
    entry = AuditEntry.objects.get(action="instance.overdue")
    assert entry.after["reason"] == (
        "node gpu-a's agent took none of 3 starts sent over 90 s (it heartbeats, but does not consume its "
        "task queue node.gpu-a: see its log)"
    )
    instance.refresh_from_db()  # and started afresh, as any failure is, after its backoff (passed already)
    assert (instance.state, instance.failure_streak, instance.restarts, instance.dispatches) == (S.PENDING, 1, 1, 1)


@pytest.mark.parametrize(
    ("state", "deadline", "reason"),
    [
        (S.DOWNLOADING, {"download_stall_s": 600}, "its download reported no progress for 600 s"),
        (S.STARTING, {"start_deadline_s": 600}, "its worker did not become ready within 600 s of starting"),
    ],
)
def test_a_download_or_a_start_that_stalls_past_its_deadline_fails_with_the_reason(
    dispatcher: RecordingDispatcher, clock: Clock, state: str, deadline: dict[str, float], reason: str
) -> None:
    make_node("gpu-a", (80,))
    deploy("chat", gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock, node_timeout_s=HOUR, backoff_max_s=HOUR, **deadline)
    reconciler.run_once()
    [instance] = instances("chat")
    agent_reports(instance, state)

    clock.advance(590)
    reconciler.run_once()
    instance.refresh_from_db()
    assert instance.state == state
    clock.advance(20)
    report = reconciler.run_once()

    instance.refresh_from_db()
    assert report is not None and (report.overdue, report.restarted) == (1, 1)
    assert AuditEntry.objects.get(action="instance.overdue").after["reason"] == reason
    assert (instance.state, instance.failure_streak, instance.restarts) == (S.PENDING, 1, 1)


def test_a_stop_is_sent_again_only_after_the_workers_grace_has_passed(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    make_node("gpu-a", (80,))
    pipeline = deploy("chat", gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock, resend_after_s=30, stop_grace_s=60, node_timeout_s=HOUR)
    reconciler.run_once()
    agent_reports(instances("chat")[0], S.READY)
    dispatcher.take()
    pipeline_actions.stop_pipeline(TEST_ACTOR, pipeline)
    reconciler.run_once()
    [sent] = dispatcher.sent
    assert sent.task == STOP and sent.expires_s == 90
    dispatcher.take()

    clock.advance(80)  # the worker may still be draining: a second stop now would be noise
    reconciler.run_once()
    assert dispatcher.take() == []
    clock.advance(11)
    reconciler.run_once()
    assert [task for _, task, _ in dispatcher.take()] == [STOP]


@pytest.mark.parametrize("restart", [False, True])
def test_a_stop_its_agent_never_confirms_is_taken_as_done_and_its_worker_fenced(
    etcd_server: EtcdServer, dispatcher: RecordingDispatcher, clock: Clock, restart: bool
) -> None:
    """gpu-a heartbeats but never acts on its stops (an agent that judged them expired on a wrong clock, or
    stuck): a scale-down or a restart waiting on it must not hang for ever."""
    make_node("gpu-a", (80,))
    pipeline = deploy("chat", gpus_per_replica=1)
    settings = {"resend_after_s": 30, "stop_grace_s": 30, "max_dispatches": 3, "node_timeout_s": HOUR}
    reconciler = make_reconciler(dispatcher, clock, etcd_endpoints=(etcd_server.endpoint,), **settings)
    reconciler.run_once()
    [instance] = instances("chat")
    agent_reports(instance, S.READY, worker_id=0xC1)
    if restart:
        instance_actions.restart_instance(TEST_ACTOR, Instance.objects.get(pk=instance.pk))
    else:
        pipeline_actions.stop_pipeline(TEST_ACTOR, pipeline)
    dispatcher.take()
    for _ in range(3):
        reconciler.run_once()
        clock.advance(61)
    assert [task for _, task, _ in dispatcher.take()] == [STOP] * 3
    instance.refresh_from_db()
    assert instance.state == S.STOPPING

    report = reconciler.run_once()

    assert report is not None and (report.overdue, report.fenced) == (1, 1)
    reason = "node gpu-a's agent confirmed none of 3 stops sent over 180 s: taken as stopped, and its worker fenced"
    assert reason in AuditEntry.objects.get(action="instance.stop_unconfirmed").after["why"]
    assert "confirmed none of 3 stops" in etcd_values(etcd_server, FENCES_PREFIX)[fence_key(0xC1)]
    instance.refresh_from_db()
    if restart:  # placed anew at the next attempt (on gpu-a again: it is the only node)
        assert (instance.state, instance.restarts, instance.restart_requested) == (S.PENDING, 1, False)
    else:
        assert (instance.state, instance.pid) == (S.STOPPED, None)


def test_a_group_short_of_its_replicas_gets_them_back(dispatcher: RecordingDispatcher, clock: Clock) -> None:
    make_node("gpu-a", (80, 80))
    deploy("chat", replicas=2, gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock, node_timeout_s=HOUR)
    reconciler.run_once()
    first, second = instances("chat")
    agent_reports(first, S.READY)
    instance_actions.restart_instance(TEST_ACTOR, Instance.objects.get(pk=first.pk))  # stopping, to restart in place
    Instance.objects.filter(pk=second.pk).delete()  # lost some way no action replaced
    dispatcher.take()

    report = reconciler.run_once()

    assert report is not None and report.replaced == 1  # the restarting one still counts
    live = [i for i in instances("chat") if i.state != S.STOPPING]
    assert [(i.replica, i.state) for i in live] == [(2, S.PENDING)]
    assert live[0].node is not None  # placed, and its start sent
    assert AuditEntry.objects.get(action="instance.create", target_id=live[0].pk).after["reason"] == (
        "replaces a lost replica"
    )
    assert make_reconciler(dispatcher, clock, node_timeout_s=HOUR).run_once().replaced == 0  # type: ignore[union-attr]


def test_an_update_of_engine_args_replaces_the_instances_one_at_a_time_each_new_one_ready_first(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    make_node("gpu-a", (80, 80))
    make_node("gpu-b", (80, 80))
    pipeline = deploy("chat", replicas=2, gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock, node_timeout_s=HOUR)
    reconciler.run_once()
    first, second = instances("chat")
    agent_reports(first, S.READY)
    agent_reports(second, S.READY)
    dispatcher.take()

    group = pipeline_actions.update_group(TEST_ACTOR, pipeline, engine_args={"speedup_ratio": 50})
    assert group.generation == 2
    report = reconciler.run_once()

    assert report is not None and report.rolled == 1
    [new_first] = [i for i in instances("chat") if i.replaces_id == first.pk]
    assert (new_first.generation, new_first.state) == (2, S.PENDING)
    [sent] = dispatcher.sent
    assert isinstance(sent.message, StartInstance) and sent.message.spec.instance_id == new_first.pk
    assert "--extra-engine-args" in sent.message.spec.engine_args
    assert '{"speedup_ratio":50}' in sent.message.spec.engine_args
    dispatcher.take()
    reconciler.run_once()
    assert dispatcher.take() == []  # one at a time: the second waits for the first replacement
    assert [i.state for i in instances("chat") if i.pk in (first.pk, second.pk)] == [S.READY, S.READY]

    agent_reports(new_first, S.READY)
    report = reconciler.run_once()

    assert report is not None and (report.retired, report.rolled) == (1, 1)
    first.refresh_from_db()
    assert first.state == S.STOPPING  # replaced: its replacement serves
    [new_second] = [i for i in instances("chat") if i.replaces_id == second.pk]
    agent_reports(new_second, S.READY)
    reconciler.run_once()
    live = [(i.generation, i.state) for i in instances("chat") if i.state in (S.READY, S.PENDING)]
    assert live == [(2, S.READY), (2, S.READY)]
    assert make_reconciler(dispatcher, clock, node_timeout_s=HOUR).run_once().rolled == 0  # type: ignore[union-attr]


def test_an_update_with_no_room_for_a_second_copy_restarts_in_place(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    make_node("gpu-a", (80,))
    pipeline = deploy("chat", gpus_per_replica=1)
    reconciler = make_reconciler(dispatcher, clock, node_timeout_s=HOUR)
    reconciler.run_once()
    [instance] = instances("chat")
    agent_reports(instance, S.READY)
    dispatcher.take()

    pipeline_actions.update_group(TEST_ACTOR, pipeline, engine_args={"speedup_ratio": 5})
    reconciler.run_once()

    instance.refresh_from_db()
    assert (instance.state, instance.restart_requested, instance.generation) == (S.STOPPING, True, 2)
    assert dispatcher.take() == [("node.gpu-a", STOP, instance.pk)]
    agent_reports(instance, S.STOPPED)
    reconciler.run_once()
    [sent] = dispatcher.sent
    assert isinstance(sent.message, StartInstance) and '{"speedup_ratio":5}' in sent.message.spec.engine_args


def test_a_change_of_router_settings_rolls_out_with_a_new_router_generation(
    dispatcher: RecordingDispatcher, clock: Clock
) -> None:
    make_node("gpu-a", (80, 80))
    pipeline = deploy("chat", gpus_per_replica=1, router_mode="round-robin")
    reconciler = make_reconciler(dispatcher, clock, node_timeout_s=HOUR)
    reconciler.run_once()
    [instance] = instances("chat")
    agent_reports(instance, S.READY)
    dispatcher.take()

    pipeline_actions.update_pipeline(TEST_ACTOR, pipeline, placement_policy="binpack")  # no restart for that
    reconciler.run_once()
    assert dispatcher.take() == []
    pipeline_actions.update_pipeline(TEST_ACTOR, pipeline, router_mode="kv")
    reconciler.run_once()

    [sent] = dispatcher.sent
    assert isinstance(sent.message, StartInstance)
    assert sent.message.spec.router is not None
    assert (sent.message.spec.router.mode, sent.message.spec.router.generation) == ("kv", 2)


def test_eviction_must_not_come_before_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_NODE_TIMEOUT_S", "30")
    monkeypatch.setenv("FLOTILLA_NODE_EVICT_S", "20")
    with pytest.raises(ConfigError, match="FLOTILLA_NODE_EVICT_S=20 is shorter than FLOTILLA_NODE_TIMEOUT_S=30"):
        ReconcilerSettings.from_env()
    monkeypatch.setenv("FLOTILLA_NODE_EVICT_S", "600")
    monkeypatch.setenv("FLOTILLA_DISRUPTION_SHARE", "1.5")
    with pytest.raises(ConfigError, match=r"FLOTILLA_DISRUPTION_SHARE=1\.5 is a share"):
        ReconcilerSettings.from_env()


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_NODE_TIMEOUT_S", "30")
    monkeypatch.setenv("FLOTILLA_MAX_RESTARTS", "3")
    settings = ReconcilerSettings.from_env()
    assert (settings.node_timeout_s, settings.max_restarts, settings.interval_s) == (30, 3, 2)
    assert (settings.evict_after_s, settings.disruption_share) == (300, 0.5)


def test_a_malformed_setting_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_MAX_RESTARTS", "many")
    with pytest.raises(Exception, match="FLOTILLA_MAX_RESTARTS='many' is not an integer"):
        ReconcilerSettings.from_env()
