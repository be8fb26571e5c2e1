"""Pipeline actions: deploy, update, scale, stop, start, delete, placing pending instances; their audit."""

import pytest
from django.db import IntegrityError, transaction

from controlplane.audit.models import AuditEntry
from controlplane.deployments import pipelines as pipeline_actions
from controlplane.deployments import upkeep
from controlplane.deployments.instance_states import InstanceState
from controlplane.deployments.models import Instance, Pipeline, WorkerGroup
from controlplane.deployments.pipelines import GroupSpec
from controlplane.deployments.placement import Placement, Unschedulable
from controlplane.errors import Conflict, Invalid
from controlplane.fleet.models import Node
from tests.controlplane.factories import TEST_ACTOR, GiB, deploy, make_model, make_node, run_instance

pytestmark = pytest.mark.django_db
S = InstanceState


def states(pipeline: Pipeline) -> list[str]:
    return list(pipeline.instances.order_by("replica").values_list("state", flat=True))


def test_deploying_creates_the_group_and_its_pending_unplaced_instances() -> None:
    pipeline = deploy("chat", replicas=2, router_mode="kv")
    group = pipeline.groups.get()
    assert (group.role, group.engine, group.replicas, group.endpoint) == (
        "aggregated",
        "mocker",
        2,
        "dyn://chat.backend.generate",
    )
    assert [(i.state, i.node_id, i.replica) for i in pipeline.instances.order_by("replica")] == [
        (S.PENDING, None, 0),
        (S.PENDING, None, 1),
    ]
    entry = AuditEntry.objects.get(action="pipeline.deploy")
    assert entry.before is None
    assert entry.after["router_mode"] == "kv"
    assert entry.after["groups"][0]["replicas"] == 2
    assert AuditEntry.objects.filter(action="instance.create").count() == 2


def test_the_namespace_is_derived_from_the_served_name_and_kept_unique() -> None:
    model = make_model("qwen")
    first = deploy("Qwen/Qwen3-0.6B", model)
    second = deploy("Qwen:Qwen3-0.6B", model)
    assert (first.namespace, second.namespace) == ("Qwen-Qwen3-0-6B", "Qwen-Qwen3-0-6B-2")


def test_a_taken_name_or_namespace_is_a_conflict() -> None:
    model = make_model("smol")
    deploy("chat", model)
    with pytest.raises(Conflict, match=r"^a pipeline named 'chat' already exists$"):  # no namespace nobody has
        deploy("chat", model)
    with pytest.raises(Conflict, match="namespace 'chat' belongs to another pipeline"):
        deploy("other", model, namespace="chat")


def test_a_served_name_that_differs_only_in_case_is_a_conflict_naming_the_pipeline_that_has_it() -> None:
    model = make_model("smol")
    deploy("Qwen/Chat", model)
    with pytest.raises(Conflict, match=r"a pipeline named 'Qwen/Chat' already exists \(served names may not differ"):
        deploy("qwen/chat", model)
    assert list(Pipeline.objects.values_list("name", flat=True)) == ["Qwen/Chat"]


def test_the_database_refuses_served_names_that_differ_only_in_case_from_a_concurrent_deploy() -> None:
    deploy("chat")
    with pytest.raises(IntegrityError), transaction.atomic():  # the checks are passed by a concurrent deploy
        Pipeline.objects.create(name="CHAT", namespace="other", model=make_model("other"))


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([], "at least one worker group"),
        ([GroupSpec(role="prefill")], "one prefill and one decode"),
        ([GroupSpec(), GroupSpec()], "one aggregated group"),
        ([GroupSpec(engine="vllm")], "vllm runs on GPUs"),
        ([GroupSpec(engine="llamacpp")], "llamacpp loads GGUF files"),
        ([GroupSpec(replicas=10_000)], "replicas must be between 0 and 512"),
        (
            [GroupSpec(role="prefill", engine="echo_core"), GroupSpec(role="decode", engine="echo_core")],
            "echo_core cannot hand a prompt's KV cache between workers yet; engines that can: mocker, sglang, "
            "trtllm, vllm",
        ),
    ],
)
def test_impossible_groups_are_refused_naming_the_groups(groups: list[GroupSpec], message: str) -> None:
    with pytest.raises(Invalid, match=message) as caught:
        pipeline_actions.deploy_pipeline(TEST_ACTOR, name="chat", model=make_model("smol"), groups=groups)
    assert caught.value.field == "groups"
    assert not Pipeline.objects.exists()


def test_prefill_and_decode_groups_make_one_pipeline() -> None:
    groups = [GroupSpec(role="prefill", gpus_per_replica=1), GroupSpec(role="decode", replicas=2, gpus_per_replica=1)]
    pipeline = pipeline_actions.deploy_pipeline(TEST_ACTOR, name="disagg", model=make_model("smol"), groups=groups)
    endpoints = sorted(group.endpoint for group in pipeline.groups.all())
    assert endpoints == ["dyn://disagg.decode.generate", "dyn://disagg.prefill.generate"]
    assert pipeline.instances.count() == 3


@pytest.mark.parametrize(
    ("settings", "field", "message"),
    [
        ({"pinned_nodes": ["ghost"]}, "pinned_nodes", "no node is named 'ghost'"),
        ({"pinned_gpus": [0]}, "pinned_gpus", "cannot hold a replica that needs 2"),
        ({"kv_overlap_score_weight": float("nan")}, "kv_overlap_score_weight", "between 0 and 1000"),
        ({"kv_queued_prefill_weight": 1.5}, "kv_queued_prefill_weight", "between 0 and 1$"),
        ({"router_temperature": -1.0}, "router_temperature", "between 0 and 100"),
        ({"colour": "blue"}, "colour", "no setting 'colour'"),
    ],
)
def test_impossible_settings_are_refused_naming_the_field(settings: dict, field: str, message: str) -> None:
    with pytest.raises(Invalid, match=message) as caught:
        deploy("chat", gpus_per_replica=2, **settings)
    assert caught.value.field == field


def test_updating_settings_is_audited_and_checked() -> None:
    pipeline = deploy("chat")
    pipeline_actions.update_pipeline(TEST_ACTOR, pipeline, router_mode="kv", router_temperature=0.5)
    entry = AuditEntry.objects.get(action="pipeline.update")
    assert (entry.before["router_mode"], entry.after["router_mode"]) == ("round-robin", "kv")
    assert entry.after["router_temperature"] == 0.5
    with pytest.raises(Invalid):
        pipeline_actions.update_pipeline(TEST_ACTOR, pipeline, name="renamed")


def test_scaling_up_adds_pending_instances_with_new_ordinals() -> None:
    pipeline = deploy("chat", replicas=1)
    group = pipeline_actions.scale_pipeline(TEST_ACTOR, pipeline, 3)
    assert group.replicas == 3
    assert states(pipeline) == [S.PENDING] * 3
    assert list(pipeline.instances.values_list("replica", flat=True).order_by("replica")) == [0, 1, 2]
    entry = AuditEntry.objects.get(action="pipeline.scale")
    assert (entry.before["groups"][0]["replicas"], entry.after["groups"][0]["replicas"]) == (1, 3)


def test_scaling_down_stops_the_least_advanced_newest_instances_first() -> None:
    make_node("gpu-a", (80, 80))
    pipeline = deploy("chat", replicas=2, gpus_per_replica=1)
    upkeep.place_pending_instances(TEST_ACTOR)
    ready = run_instance(pipeline.instances.select_related("node", "pipeline", "group").get(replica=0))
    pipeline_actions.scale_pipeline(TEST_ACTOR, pipeline, 3)  # replica 2: pending, unplaced
    pipeline_actions.scale_pipeline(TEST_ACTOR, pipeline, 1)
    # The unplaced one stops at once; the placed pending one may be starting on its node: stopping.
    assert states(pipeline) == [S.READY, S.STOPPING, S.STOPPED]
    ready.refresh_from_db()
    assert ready.state == S.READY
    assert pipeline.instances.get(replica=2).reason == "scaled down to 1 by system:tests"


def test_scaling_a_pipeline_with_several_groups_needs_the_role() -> None:
    groups = [GroupSpec(role="prefill"), GroupSpec(role="decode")]
    pipeline = pipeline_actions.deploy_pipeline(TEST_ACTOR, name="disagg", model=make_model("smol"), groups=groups)
    with pytest.raises(Invalid, match="say which") as caught:
        pipeline_actions.scale_pipeline(TEST_ACTOR, pipeline, 2)
    assert caught.value.field == "role"
    pipeline_actions.scale_pipeline(TEST_ACTOR, pipeline, 2, role="decode")
    assert pipeline.groups.get(role="decode").instances.count() == 2


def test_stopping_stops_every_instance_and_starting_brings_the_replicas_back() -> None:
    pipeline = deploy("chat", replicas=2)
    pipeline = pipeline_actions.stop_pipeline(TEST_ACTOR, pipeline)
    assert pipeline.state == Pipeline.State.STOPPED
    assert states(pipeline) == [S.STOPPED, S.STOPPED]
    with pytest.raises(Conflict, match="stopped already"):
        pipeline_actions.stop_pipeline(TEST_ACTOR, pipeline)
    pipeline_actions.scale_pipeline(TEST_ACTOR, pipeline, 3)  # a stopped pipeline only records the count
    assert pipeline.instances.filter(state=S.PENDING).count() == 0
    pipeline_actions.start_pipeline(TEST_ACTOR, pipeline)
    assert pipeline.instances.filter(state=S.PENDING).count() == 3
    with pytest.raises(Conflict, match="running already"):
        pipeline_actions.start_pipeline(TEST_ACTOR, pipeline)
    assert AuditEntry.objects.filter(action__in=["pipeline.stop", "pipeline.start"]).count() == 2


def test_a_pipeline_is_deleted_only_once_stopped_and_its_instances_gone() -> None:
    make_node("gpu-a", (80,))
    pipeline = deploy("chat", gpus_per_replica=1)
    upkeep.place_pending_instances(TEST_ACTOR)
    run_instance(pipeline.instances.select_related("node", "pipeline", "group").get())
    with pytest.raises(Conflict, match="stop it first"):
        pipeline_actions.delete_pipeline(TEST_ACTOR, pipeline)
    pipeline_actions.stop_pipeline(TEST_ACTOR, pipeline)
    with pytest.raises(Conflict, match="1 instance\\(s\\) stopping"):
        pipeline_actions.delete_pipeline(TEST_ACTOR, pipeline)
    pipeline.instances.update(state=S.STOPPED)
    pipeline_actions.delete_pipeline(TEST_ACTOR, pipeline)
    assert not Pipeline.objects.exists()
    assert AuditEntry.objects.get(action="pipeline.delete").before["name"] == "chat"


def test_placing_assigns_nodes_and_gpus_to_pending_instances() -> None:
    make_node("gpu-a", (80, 80))
    make_node("gpu-b", (80, 80))
    pipeline = deploy("chat", make_model("smol", memory_bytes=20 * GiB), replicas=2, gpus_per_replica=1)
    [(group, result)] = upkeep.place_pending_instances(TEST_ACTOR)
    assert isinstance(result, Placement)
    assert group == pipeline.groups.get()
    placed = list(pipeline.instances.order_by("replica").values_list("node__name", "gpu_indexes", "state"))
    assert placed == [("gpu-a", [0], S.PENDING), ("gpu-b", [0], S.PENDING)]
    assert AuditEntry.objects.filter(action="instance.place").count() == 2


def test_placed_instances_reserve_their_memory_for_later_placements() -> None:
    make_node("gpu-a", (80,))
    make_node("gpu-b", (80,))
    model = make_model("big", memory_bytes=50 * GiB)
    deploy("one", model, replicas=1, gpus_per_replica=1)
    upkeep.place_pending_instances(TEST_ACTOR)
    pipeline = deploy("two", model, replicas=1, gpus_per_replica=1)
    upkeep.place_pending_instances(TEST_ACTOR)
    # gpu-a holds 50 of its 80 GiB for "one" before it reports any use: "two" goes to gpu-b.
    nodes = set(Instance.objects.values_list("node__name", flat=True))
    assert nodes == {"gpu-a", "gpu-b"}
    assert pipeline.instances.get().node is not None


def test_what_does_not_fit_keeps_its_reason_recorded_once() -> None:
    make_node("gpu-a", (16,))
    pipeline = deploy("chat", make_model("big", memory_bytes=40 * GiB), replicas=1, gpus_per_replica=2)
    [(_, result)] = upkeep.place_pending_instances(TEST_ACTOR)
    assert isinstance(result, Unschedulable)
    reason = (
        "needs 2 GPUs with 20 GiB free each; the best node, gpu-a, has 0 (its GPU with the most free memory has 16 GiB)"
    )
    assert pipeline.instances.get().reason == reason
    upkeep.place_pending_instances(TEST_ACTOR)
    assert AuditEntry.objects.filter(action="instance.unschedulable").count() == 1
    # A bigger node arrives: the next pass places the instance.
    make_node("gpu-b", (80, 80))
    upkeep.place_pending_instances(TEST_ACTOR)
    instance = pipeline.instances.get()
    assert (instance.node.name if instance.node else None, instance.gpu_indexes, instance.reason) == (
        "gpu-b",
        [0, 1],
        "",
    )


def test_stopped_pipelines_are_not_placed() -> None:
    make_node("gpu-a", (80,))
    pipeline = deploy("chat", gpus_per_replica=1)
    Pipeline.objects.filter(pk=pipeline.pk).update(state=Pipeline.State.STOPPED)
    assert upkeep.place_pending_instances(TEST_ACTOR) == []
    assert not Node.objects.get().instances.exists()


def test_worker_groups_name_their_dyn_component() -> None:
    assert WorkerGroup(role="aggregated").component == "backend"
    assert WorkerGroup(role="prefill").component == "prefill"


@pytest.mark.django_db
def test_a_served_name_the_field_would_refuse_is_invalid_for_every_caller() -> None:
    model = make_model("smol")
    with pytest.raises(Invalid, match="'bad name!'") as refused:
        pipeline_actions.deploy_pipeline(TEST_ACTOR, name="bad name!", model=model, groups=[GroupSpec(replicas=1)])
    assert refused.value.field == "name"
    assert not Pipeline.objects.exists()
