"""A planner's scale-down stops the replicas it named (``Decision.drain_instances``: the least busy), through the
scale action; a person's scale-down still stops the latest replicas."""

import datetime

import pytest

from controlplane.deployments import upkeep
from controlplane.deployments.instance_states import InstanceState
from controlplane.deployments.models import Instance, Pipeline
from controlplane.deployments.pipelines import scale_pipeline
from controlplane.planning.actions import Seen, apply_decisions
from planner.decision import Decision
from tests.controlplane.factories import TEST_ACTOR, deploy, make_node, run_instance

pytestmark = pytest.mark.django_db


def three_ready() -> tuple[Pipeline, list[Instance]]:
    make_node("gpu-a", (80, 80, 80))
    pipeline = deploy("chat", replicas=3, gpus_per_replica=1)
    upkeep.place_pending_instances(TEST_ACTOR)
    instances = [run_instance(instance) for instance in Instance.objects.order_by("replica")]
    assert all(instance.endpoint_instance_id is not None for instance in instances)
    return pipeline, instances


def stopping() -> list[int]:
    return sorted(Instance.objects.filter(state=InstanceState.STOPPING).values_list("replica", flat=True))


def test_the_planners_scale_down_stops_the_replica_it_found_least_busy() -> None:
    pipeline, instances = three_ready()
    least_busy = instances[0]  # not the latest replica, which a person's scale-down would stop
    decision = Decision(
        role="aggregated",
        current=3,
        desired=2,
        wanted=2,
        mode="sla",
        reason="needs 1.6 replicas",
        drain=1,
        drain_instances=(least_busy.endpoint_instance_id or 0,),
    )
    [row] = apply_decisions(pipeline.pk, [decision], Seen(), datetime.datetime.now(datetime.UTC))
    assert row.acted
    assert stopping() == [least_busy.replica]


def test_a_persons_scale_down_stops_the_latest_replica() -> None:
    pipeline, instances = three_ready()
    scale_pipeline(TEST_ACTOR, pipeline, 2)
    assert stopping() == [instances[-1].replica]
