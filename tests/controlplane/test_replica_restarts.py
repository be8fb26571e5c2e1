"""A replica's restarts are counted across the rows that run it: a restart that starts a replacement beside the
only replica, and a stop and start of its pipeline, make new instance rows, but the Restarts column goes on."""

import pytest

from controlplane.dashboard import partials
from controlplane.deployments import evacuation
from controlplane.deployments import instances as instance_actions
from controlplane.deployments import pipelines as pipeline_actions
from controlplane.deployments.instance_states import InstanceState
from controlplane.deployments.models import Instance, Pipeline
from controlplane.deployments.upkeep import place_pending_instances
from tests.controlplane.factories import TEST_ACTOR, deploy, make_node, run_instance

pytestmark = pytest.mark.django_db
S = InstanceState


def restarts_cell(instance: Instance) -> str:
    """The text of the Restarts cell of the instance's row, as the pipeline page shows it."""
    html = partials.render_instance(instance.pk, can_act=False)
    return html.split('role="cell">')[6].split("<", 1)[0]


def place_and_run_all() -> list[Instance]:
    """Place the pending instances and bring them to ready, as their agents would report them."""
    place_pending_instances(TEST_ACTOR)
    placed = Instance.objects.select_related("node", "pipeline", "group").filter(state=S.PENDING, node__isnull=False)
    return [run_instance(instance) for instance in placed.order_by("replica")]


def stop(pipeline: Pipeline) -> None:
    """Stop the pipeline, its agents confirming each instance stopped."""
    pipeline_actions.stop_pipeline(TEST_ACTOR, pipeline)
    Instance.objects.filter(state=S.STOPPING).update(state=S.STOPPED, node=None, gpu_indexes=[])


def test_the_replacement_of_a_restarted_only_replica_counts_the_restart() -> None:
    make_node("gpu-a", (80, 80))
    deploy("chat", gpus_per_replica=1)
    (instance,) = place_and_run_all()

    instance_actions.restart_instance(TEST_ACTOR, instance)
    (replacement,) = place_and_run_all()
    evacuation.retire_replaced_instances(TEST_ACTOR)

    assert replacement.name != instance.name  # a new row and name, the same replica
    assert replacement.replica_restarts == 1
    assert restarts_cell(replacement) == "1"


def test_a_stop_and_start_of_the_pipeline_counts_a_restart_of_each_replica() -> None:
    make_node("gpu-a", (80, 80))
    pipeline = deploy("chat", replicas=2, gpus_per_replica=1)
    place_and_run_all()

    stop(pipeline)
    pipeline_actions.start_pipeline(TEST_ACTOR, pipeline)
    started = place_and_run_all()
    assert [instance.replica_restarts for instance in started] == [1, 1]

    stop(pipeline)
    pipeline_actions.start_pipeline(TEST_ACTOR, pipeline)
    again = place_and_run_all()
    assert sorted(restarts_cell(instance) for instance in again) == ["2", "2"]


def test_a_scale_up_adds_new_replicas_with_no_restarts() -> None:
    make_node("gpu-a", (80, 80))
    pipeline = deploy("chat", gpus_per_replica=1)
    place_and_run_all()
    pipeline_actions.scale_pipeline(TEST_ACTOR, pipeline, 2)
    (added,) = place_and_run_all()
    assert added.replica_restarts == 0
