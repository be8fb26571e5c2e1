"""Fleet actions: registration, heartbeats, drains, agent reports, restarts, and their audit entries."""

import pytest

from controlplane.audit.models import AuditEntry
from controlplane.audit.records import Actor
from controlplane.deployments import evacuation
from controlplane.deployments import instances as instance_actions
from controlplane.deployments.instance_states import InstanceState
from controlplane.deployments.models import Instance
from controlplane.deployments.upkeep import place_pending_instances
from controlplane.errors import Conflict, Forbidden, Invalid, InvalidTransition, Missing
from controlplane.fleet import actions as fleet_actions
from controlplane.fleet.models import Download, Node
from runtime.fleet_contract.reports import DownloadReport, InstanceReport
from tests.controlplane.factories import TEST_ACTOR, GiB, deploy, make_model, make_node, node_report, run_instance

pytestmark = pytest.mark.django_db
S = InstanceState


def placed_instance(replicas: int = 1) -> Instance:
    make_node("gpu-a", (80, 80))
    pipeline = deploy(replicas=replicas, gpus_per_replica=1)
    place_pending_instances(TEST_ACTOR)
    return pipeline.instances.select_related("node", "pipeline", "group").order_by("replica").first()  # type: ignore[return-value]


def report(instance: Instance, state: str, **fields: object) -> Instance:
    assert instance.node is not None
    name = instance.node.name
    return instance_actions.report_instance_state(
        Actor.agent(name), name, instance.pk, InstanceReport(state=state, **fields)
    )  # type: ignore[arg-type]


def test_registering_a_node_stores_its_gpus_and_records_it() -> None:
    node = make_node("gpu-a", (80, 40))
    assert node.state == Node.State.ONLINE
    assert list(node.gpus.values_list("index", "memory_total_bytes")) == [(0, 80 * GiB), (1, 40 * GiB)]
    entry = AuditEntry.objects.get(action="node.register")
    assert entry.actor_name == "agent:gpu-a"
    assert entry.before is None
    assert [gpu["index"] for gpu in entry.after["gpus"]] == [0, 1]


def test_registering_again_updates_the_gpus_and_keeps_the_drain() -> None:
    node = make_node("gpu-a", (80, 40))
    evacuation.drain_node(TEST_ACTOR, node)
    node = make_node("gpu-a", (80,))
    assert node.draining
    assert list(node.gpus.values_list("index", flat=True)) == [0]
    entry = AuditEntry.objects.filter(action="node.register").first()
    assert entry is not None
    assert (len(entry.before["gpus"]), len(entry.after["gpus"])) == (2, 1)


def test_a_heartbeat_with_new_usage_only_is_not_audited() -> None:
    make_node("gpu-a", (80,))
    node = fleet_actions.heartbeat(Actor.agent("gpu-a"), "gpu-a", node_report((80,), used_gib=12))
    assert node.gpus.get().memory_used_bytes == 12 * GiB
    assert not AuditEntry.objects.filter(action="node.heartbeat").exists()


def test_a_heartbeat_with_changed_hardware_is_audited() -> None:
    make_node("gpu-a", (80,))
    fleet_actions.heartbeat(Actor.agent("gpu-a"), "gpu-a", node_report((80, 80)))
    entry = AuditEntry.objects.get(action="node.heartbeat")
    assert (len(entry.before["gpus"]), len(entry.after["gpus"])) == (1, 2)


def test_a_gpu_swapped_for_another_at_its_index_is_stored_and_audited() -> None:
    agent = Actor.agent("gpu-a")
    fleet_actions.register_node(agent, "gpu-a", node_report((80, 80), uuids=("GPU-aaaa", "GPU-bbbb")))
    node = fleet_actions.heartbeat(agent, "gpu-a", node_report((80, 80), uuids=("GPU-aaaa", "GPU-cccc")))
    assert list(node.gpus.values_list("uuid", flat=True)) == ["GPU-aaaa", "GPU-cccc"]
    entry = AuditEntry.objects.get(action="node.heartbeat")
    assert (entry.before["gpus"][1]["uuid"], entry.after["gpus"][1]["uuid"]) == ("GPU-bbbb", "GPU-cccc")


def test_a_heartbeat_brings_an_offline_node_back_online_and_is_audited() -> None:
    node = make_node("gpu-a", (80,))
    Node.objects.filter(pk=node.pk).update(state=Node.State.OFFLINE)
    node = fleet_actions.heartbeat(Actor.agent("gpu-a"), "gpu-a", node_report((80,)))
    assert node.state == Node.State.ONLINE
    entry = AuditEntry.objects.get(action="node.heartbeat")
    assert (entry.before["state"], entry.after["state"]) == ("offline", "online")


def test_a_heartbeat_from_an_unregistered_node_asks_it_to_register() -> None:
    with pytest.raises(Missing, match="register it first"):
        fleet_actions.heartbeat(Actor.agent("ghost"), "ghost", node_report())


def test_draining_keeps_a_ready_instance_until_its_replacement_elsewhere_is_ready() -> None:
    instance = run_instance(placed_instance())
    make_node("gpu-b", (80, 80))
    node = Node.objects.get(name="gpu-a")

    evacuation.drain_node(TEST_ACTOR, node)

    instance.refresh_from_db()
    assert instance.state == S.READY  # it serves on while its replacement starts
    replacement = Instance.objects.exclude(pk=instance.pk).get()
    assert (replacement.state, replacement.node, replacement.replica) == (S.PENDING, None, 1)
    assert replacement.replaces == instance
    entry = AuditEntry.objects.get(action="node.drain")
    assert entry.after["moved_instances"] == [
        {"instance": instance.pk, "replacement": replacement.pk, "stopped_at_once": S.READY}
    ]
    assert (entry.before["draining"], entry.after["draining"], entry.after["force"]) == (False, True, False)
    place_pending_instances(TEST_ACTOR)
    replacement.refresh_from_db()
    assert replacement.node is not None and replacement.node.name == "gpu-b"

    assert evacuation.retire_replaced_instances(TEST_ACTOR) == 0  # not ready yet
    run_instance(replacement)
    assert evacuation.retire_replaced_instances(TEST_ACTOR) == 1
    instance.refresh_from_db()
    assert (instance.state, instance.reason) == (S.STOPPING, f"replaced by {replacement.name} on node gpu-b")


def test_draining_the_last_place_a_pipeline_fits_is_refused_unless_forced() -> None:
    instance = run_instance(placed_instance())
    node = Node.objects.get(name="gpu-a")

    stranded = r"draining gpu-a would stop pipeline smol \(no node can take new instances: gpu-a is draining\)"
    with pytest.raises(Conflict, match=stranded):
        evacuation.drain_node(TEST_ACTOR, node)

    node.refresh_from_db()
    assert not node.draining and Instance.objects.count() == 1  # nothing changed
    evacuation.drain_node(TEST_ACTOR, node, force=True)
    instance.refresh_from_db()
    assert (instance.state, instance.reason) == (S.STOPPING, "node gpu-a was drained by system:tests")
    replacement = Instance.objects.exclude(pk=instance.pk).get()
    assert (replacement.state, replacement.replaces) == (S.PENDING, instance)


def test_a_drained_node_gets_no_new_instances_until_undrained() -> None:
    instance = placed_instance()
    node = Node.objects.get(name="gpu-a")
    evacuation.drain_node(TEST_ACTOR, node, force=True)
    with pytest.raises(Conflict, match="draining already"):
        evacuation.drain_node(TEST_ACTOR, node)
    [(_, result)] = place_pending_instances(TEST_ACTOR)
    assert "gpu-a is draining" in result.reason  # type: ignore[union-attr]
    evacuation.undrain_node(TEST_ACTOR, node)
    assert AuditEntry.objects.filter(action="node.undrain").exists()
    place_pending_instances(TEST_ACTOR)
    assert Instance.objects.exclude(pk=instance.pk).get().node == node


def test_a_cordoned_node_gets_nothing_new_and_keeps_what_it_runs() -> None:
    instance = run_instance(placed_instance())
    node = Node.objects.get(name="gpu-a")
    fleet_actions.cordon_node(TEST_ACTOR, node)
    with pytest.raises(Conflict, match="is cordoned already"):
        fleet_actions.cordon_node(TEST_ACTOR, node)

    second = deploy("second", gpus_per_replica=0)
    [(_, result)] = place_pending_instances(TEST_ACTOR)

    assert "gpu-a is cordoned" in result.reason  # type: ignore[union-attr]
    instance.refresh_from_db()
    assert instance.state == S.READY
    fleet_actions.uncordon_node(TEST_ACTOR, node)
    place_pending_instances(TEST_ACTOR)
    assert second.instances.get().node == node
    assert [e.action for e in AuditEntry.objects.filter(action__startswith="node.c").order_by("id")] == ["node.cordon"]
    assert AuditEntry.objects.filter(action="node.uncordon").exists()


def test_a_node_with_instances_cannot_be_deleted() -> None:
    placed_instance()
    node = Node.objects.get(name="gpu-a")
    with pytest.raises(Conflict, match="drain it first"):
        evacuation.delete_node(TEST_ACTOR, node)


def test_deleting_an_idle_node_is_audited() -> None:
    node = make_node("gpu-a", (80,))
    evacuation.delete_node(TEST_ACTOR, node)
    assert not Node.objects.exists()
    assert AuditEntry.objects.get(action="node.delete").before["name"] == "gpu-a"


def test_an_instance_goes_through_its_states_as_the_agent_reports_them() -> None:
    instance = placed_instance()
    instance = report(instance, S.DOWNLOADING, download_progress=0.25)
    assert (instance.state, instance.download_progress) == (S.DOWNLOADING, 0.25)
    instance = report(instance, S.DOWNLOADING, download_progress=0.75)
    instance = report(instance, S.STARTING, pid=77)
    instance = report(instance, S.READY, endpoint_instance_id=0x1F)
    instance.refresh_from_db()
    assert (instance.state, instance.pid, instance.endpoint_instance_id) == (S.READY, 77, 0x1F)
    assert instance.download_progress is None
    states = [
        (entry.before["state"], entry.after["state"])
        for entry in AuditEntry.objects.filter(action="instance.state").order_by("id")
    ]
    # The repeated "downloading" (progress only) is not audited.
    assert states == [("pending", "downloading"), ("downloading", "starting"), ("starting", "ready")]


def test_a_failure_keeps_its_reason_and_a_missing_reason_is_said() -> None:
    instance = report(placed_instance(), S.FAILED, reason="CUDA out of memory")
    assert (instance.state, instance.reason) == (S.FAILED, "CUDA out of memory")
    other = report(placed_instance_on_same_node(), S.FAILED)
    assert other.reason == "the agent gave no reason"


def placed_instance_on_same_node() -> Instance:
    pipeline = deploy("second", replicas=1, gpus_per_replica=1)
    place_pending_instances(TEST_ACTOR)
    return pipeline.instances.select_related("node", "pipeline", "group").get()


def test_an_agent_may_not_report_on_another_nodes_instance() -> None:
    instance = placed_instance()
    with pytest.raises(Forbidden, match="is on node gpu-a, not on node gpu-b"):
        instance_actions.report_instance_state(
            Actor.agent("gpu-b"), "gpu-b", instance.pk, InstanceReport(state=S.READY)
        )


def test_reports_on_unknown_instances_and_control_plane_states_are_refused() -> None:
    with pytest.raises(Missing):
        instance_actions.report_instance_state(Actor.agent("gpu-a"), "gpu-a", 999, InstanceReport(state=S.READY))
    instance = placed_instance()
    with pytest.raises(Invalid, match="not 'stopping'") as caught:
        report(instance, S.STOPPING)
    assert caught.value.field == "state"


def test_a_state_that_cannot_follow_is_refused_and_nothing_changes() -> None:
    instance = run_instance(placed_instance())
    with pytest.raises(InvalidTransition, match="from ready to downloading"):
        report(instance, S.DOWNLOADING)
    instance.refresh_from_db()
    assert instance.state == S.READY


def test_a_report_about_an_older_attempt_is_refused_and_changes_nothing() -> None:
    """A late report from the worker of attempt 0, after the instance was restarted (attempt 1)."""
    instance = report(placed_instance(), S.FAILED, reason="crashed", attempt=0)
    instance = instance_actions.restart_instance(TEST_ACTOR, instance)
    place_pending_instances(TEST_ACTOR)
    assert instance.restarts == 1

    with pytest.raises(Conflict, match=r"about attempt 0 of instance .*, which is at attempt 1 now"):
        report(Instance.objects.select_related("node").get(pk=instance.pk), S.READY, attempt=0)

    instance.refresh_from_db()
    assert instance.state == S.PENDING
    instance = report(Instance.objects.select_related("node").get(pk=instance.pk), S.READY, attempt=1)
    assert instance.state == S.READY


def test_an_agent_may_not_claim_another_instances_worker_as_its_own() -> None:
    theirs = run_instance(placed_instance())  # its worker is 0xabc
    make_node("gpu-b", (80,))
    mine = deploy("mine", gpus_per_replica=0, pinned_nodes=["gpu-b"])
    place_pending_instances(TEST_ACTOR)
    instance = mine.instances.select_related("node").get()

    with pytest.raises(Forbidden, match=r"worker abc is instance .*'s, not mine-aggregated-0's: node gpu-b may"):
        report(instance, S.READY, endpoint_instance_id=0xABC)

    instance.refresh_from_db()
    assert (instance.state, instance.endpoint_instance_id) == (S.PENDING, None)
    assert Instance.objects.get(pk=theirs.pk).endpoint_instance_id == 0xABC


def test_an_agent_says_stopped_only_of_an_instance_being_stopped() -> None:
    instance = run_instance(placed_instance())
    with pytest.raises(InvalidTransition, match="is ready, not stopping: an agent reports 'stopped' only for"):
        report(instance, S.STOPPED)
    pending = placed_instance_on_same_node()
    with pytest.raises(InvalidTransition, match="is pending, not stopping"):
        report(pending, S.STOPPED)
    instance.refresh_from_db()
    pending.refresh_from_db()
    assert (instance.state, pending.state) == (S.READY, S.PENDING)


def test_a_failure_retrying_cannot_fix_gives_up_at_once_and_lets_the_gpus_go() -> None:
    instance = placed_instance()
    assert instance.gpu_indexes == [0]

    instance = report(instance, S.FAILED, reason="repository 'org/nope' not found", permanent=True)

    assert (instance.state, instance.gave_up, instance.node, instance.gpu_indexes) == (S.FAILED, True, None, [])
    assert instance.reason == "gave up on node gpu-a, as retrying cannot fix it: repository 'org/nope' not found"
    revived = instance_actions.restart_instance(TEST_ACTOR, instance)  # a person's restart, once the cause is fixed
    assert (revived.state, revived.gave_up, revived.failure_streak) == (S.PENDING, False, 0)


def test_an_instance_that_fails_while_stopping_is_stopped() -> None:
    instance = run_instance(placed_instance())
    evacuation.drain_node(TEST_ACTOR, Node.objects.get(name="gpu-a"), force=True)
    instance = report(
        Instance.objects.select_related("node", "pipeline", "group").get(pk=instance.pk), S.FAILED, reason="killed"
    )
    assert (instance.state, instance.reason) == (S.STOPPED, "killed")


def test_restarting_a_ready_instance_stops_it_then_makes_it_pending_where_it_was() -> None:
    instance = run_instance(placed_instance(replicas=2))  # the other replica serves meanwhile
    instance = instance_actions.restart_instance(TEST_ACTOR, instance)
    assert (instance.state, instance.restart_requested) == (S.STOPPING, True)
    with pytest.raises(Conflict, match="restarting already"):
        instance_actions.restart_instance(TEST_ACTOR, instance)
    instance = report(instance, S.STOPPED)
    assert (instance.state, instance.restarts, instance.restart_requested) == (S.PENDING, 1, False)
    assert instance.node is not None and instance.node.name == "gpu-a"
    assert instance.pid is None
    entry = AuditEntry.objects.get(action="instance.restart")
    assert (entry.before["state"], entry.after["state"]) == ("ready", "stopping")


def test_a_duplicate_stopped_report_of_a_restart_restarts_nothing_twice() -> None:
    instance = run_instance(placed_instance(replicas=2))
    instance = instance_actions.restart_instance(TEST_ACTOR, instance)
    instance = report(instance, S.STOPPED, attempt=0)
    assert (instance.state, instance.restarts) == (S.PENDING, 1)
    # The agent's report sent again (a retry after a lost answer): about attempt 0, which is over.
    with pytest.raises(Conflict, match=r"attempt 0 .* at attempt 1 now"):
        report(instance, S.STOPPED, attempt=0)
    # An agent that does not say its attempt: the instance is not stopping any more, so "stopped" is refused.
    with pytest.raises(InvalidTransition, match="not stopping"):
        report(instance, S.STOPPED)
    instance.refresh_from_db()
    assert (instance.state, instance.restarts) == (S.PENDING, 1)


def test_restarting_the_only_replica_starts_its_replacement_before_stopping_it() -> None:
    instance = run_instance(placed_instance())

    instance = instance_actions.restart_instance(TEST_ACTOR, instance)

    assert instance.state == S.READY
    replacement = Instance.objects.exclude(pk=instance.pk).get()
    assert (replacement.state, replacement.replaces, replacement.reason) == (
        S.PENDING,
        instance,
        f"replaces {instance.name}",
    )
    with pytest.raises(Conflict, match="being replaced already"):
        instance_actions.restart_instance(TEST_ACTOR, instance)
    place_pending_instances(TEST_ACTOR)
    run_instance(Instance.objects.select_related("node").get(pk=replacement.pk))
    assert evacuation.retire_replaced_instances(TEST_ACTOR) == 1
    instance.refresh_from_db()
    assert instance.state == S.STOPPING


def test_restarting_a_failed_instance_makes_it_pending_again() -> None:
    instance = report(placed_instance(), S.FAILED, reason="crashed")
    instance = instance_actions.restart_instance(TEST_ACTOR, instance)
    assert (instance.state, instance.restarts, instance.reason) == (S.PENDING, 1, "")


def test_there_is_nothing_to_restart_in_a_pending_instance() -> None:
    with pytest.raises(Conflict, match="is pending: there is no process to restart"):
        instance_actions.restart_instance(TEST_ACTOR, placed_instance())


def test_download_reports_are_audited_when_their_state_changes() -> None:
    make_node("gpu-a", (80,))
    model = make_model("smol")
    agent = Actor.agent("gpu-a")
    fleet_actions.report_download(
        agent, "gpu-a", model.pk, DownloadReport(state="downloading", bytes_done=1, bytes_total=10)
    )
    download = fleet_actions.report_download(
        agent, "gpu-a", model.pk, DownloadReport(state="downloading", bytes_done=5, bytes_total=10)
    )
    assert download.progress == 0.5
    fleet_actions.report_download(agent, "gpu-a", model.pk, DownloadReport(state="done", bytes_done=10, bytes_total=10))
    assert Download.objects.get().state == Download.State.DONE
    entries = AuditEntry.objects.filter(action="download.state").order_by("id")
    assert [entry.after["state"] for entry in entries] == ["downloading", "done"]


def test_impossible_download_reports_are_refused() -> None:
    make_node("gpu-a", (80,))
    model = make_model("smol")
    with pytest.raises(Invalid, match="more than bytes_total"):
        fleet_actions.report_download(
            Actor.agent("gpu-a"), "gpu-a", model.pk, DownloadReport(state="downloading", bytes_done=11, bytes_total=10)
        )
    with pytest.raises(Missing, match="not registered"):
        fleet_actions.report_download(Actor.agent("ghost"), "ghost", model.pk, DownloadReport(state="done"))
