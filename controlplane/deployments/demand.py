"""What a worker group asks of placement: its pure ``Demand``, read from the database.

Apart from the actions so that a fleet action (a drain asking whether replacements would fit) and the
deployment actions (placing pending instances) build it one way, without importing each other.
"""

from collections import Counter

from controlplane.deployments.instance_states import LIVE_STATES
from controlplane.deployments.inventory import host_tier_bytes
from controlplane.deployments.models import WorkerGroup
from controlplane.deployments.placement import Demand


def group_demand(group: WorkerGroup, count: int) -> Demand:
    """``count`` new replicas of ``group``, spread against the replicas it has placed already."""
    pipeline = group.pipeline
    existing = Counter(
        group.instances.filter(state__in=LIVE_STATES, node__isnull=False).values_list("node__name", flat=True)
    )
    return Demand(
        replicas=count,
        gpus_per_replica=group.gpus_per_replica,
        memory_per_replica_bytes=pipeline.model.memory_bytes,
        policy=pipeline.placement_policy,  # a PlacementPolicy value
        pinned_nodes=frozenset(pipeline.pinned_nodes),
        pinned_gpus=frozenset(pipeline.pinned_gpus),
        existing_replicas_by_node=dict(existing),
        engine=group.engine,
        host_memory_per_replica_bytes=host_tier_bytes(pipeline.kv_host_cache_gib),
    )
