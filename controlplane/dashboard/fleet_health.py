"""The overview's fleet health: nodes online, instances ready and what holds the rest, pipelines short of
replicas, and the GPUs' memory and utilisation summed (a few aggregate queries, no state changes).

``summarise`` is pure (rows in, figures out); ``fleet_health`` reads the rows.
"""

from collections import Counter
from dataclasses import dataclass

from django.db.models import Avg, Count, Sum

from controlplane.dashboard import queries
from controlplane.dashboard.queries import PipelineRow
from controlplane.deployments.instance_states import LIVE_STATES, InstanceState
from controlplane.deployments.models import Instance
from controlplane.fleet.models import Gpu, Node


@dataclass(frozen=True)
class FleetHealth:
    """What the overview's health line shows."""

    nodes: int
    nodes_online: int
    instances: int  # live instances (pending, downloading, starting, ready, failed)
    ready: int
    failed: int
    waiting: int  # pending, downloading or starting
    pipelines_running: int
    pipelines_short: int
    gpus: int
    gpu_memory_used_bytes: int
    gpu_memory_total_bytes: int
    gpu_utilization_percent: float | None

    @property
    def healthy(self) -> bool:
        return self.nodes_online == self.nodes and not self.failed and not self.pipelines_short

    @property
    def gpu_memory_share(self) -> float | None:
        return self.gpu_memory_used_bytes / self.gpu_memory_total_bytes if self.gpu_memory_total_bytes else None


def summarise(
    node_states: Counter[str], instance_states: Counter[str], rows: list[PipelineRow], gpu_totals: dict[str, float]
) -> FleetHealth:
    """The figures of the fleet's node and instance counts by state, its pipelines' rows and its GPUs' sums."""
    live = sum(count for state, count in instance_states.items() if state in LIVE_STATES)
    ready = instance_states.get(InstanceState.READY, 0)
    failed = instance_states.get(InstanceState.FAILED, 0)
    running = [row for row in rows if not row.stopped]
    return FleetHealth(
        nodes=sum(node_states.values()),
        nodes_online=node_states.get(Node.State.ONLINE, 0),
        instances=live,
        ready=ready,
        failed=failed,
        waiting=live - ready - failed,
        pipelines_running=len(running),
        pipelines_short=sum(1 for row in running if row.short),
        gpus=int(gpu_totals.get("count") or 0),
        gpu_memory_used_bytes=int(gpu_totals.get("used") or 0),
        gpu_memory_total_bytes=int(gpu_totals.get("total") or 0),
        gpu_utilization_percent=gpu_totals.get("utilization"),
    )


def fleet_health(rows: list[PipelineRow] | None = None) -> FleetHealth:
    """The fleet's health now (``rows``: the pipelines' rows when the caller has them already)."""
    node_states = Counter(dict(Node.objects.values_list("state").annotate(count=Count("pk")).order_by()))
    instance_states = Counter(dict(Instance.objects.values_list("state").annotate(count=Count("pk")).order_by()))
    if rows is None:
        rows = queries.pipeline_rows(queries.pipelines_with_groups())
    gpu_totals = Gpu.objects.aggregate(
        count=Count("pk"),
        used=Sum("memory_used_bytes"),
        total=Sum("memory_total_bytes"),
        utilization=Avg("utilization_percent"),
    )
    return summarise(node_states, instance_states, rows, gpu_totals)
