"""What the overview page shows, read from the records in a few queries (no state changes here)."""

from collections import Counter
from dataclasses import dataclass, field

from django.db.models import Prefetch

from controlplane.audit.models import AuditEntry
from controlplane.deployments.models import Pipeline
from controlplane.fleet.models import Gpu, Instance, InstanceState, Node

RECENT_EVENTS = 15


@dataclass(frozen=True)
class PipelineRow:
    pipeline: Pipeline
    desired: int
    ready: int
    states: dict[str, int]  # live instances by state, for the ones not ready yet
    reasons: list[str] = field(default_factory=list)  # why instances are pending or failed


@dataclass(frozen=True)
class Overview:
    nodes: list[Node]
    pipelines: list[PipelineRow]
    events: list[AuditEntry]


def overview() -> Overview:
    """Nodes with their GPUs, pipelines with ready/desired replicas and what holds the rest, recent events."""
    nodes = list(Node.objects.prefetch_related(Prefetch("gpus", queryset=Gpu.objects.order_by("index"))))
    pipelines = Pipeline.objects.select_related("model").prefetch_related("groups").order_by("name")
    live = Instance.objects.exclude(state__in=[InstanceState.STOPPED, InstanceState.STOPPING])
    by_pipeline: dict[int, list[Instance]] = {}
    for instance in live.only("pipeline_id", "state", "reason"):
        by_pipeline.setdefault(instance.pipeline_id, []).append(instance)
    rows = []
    for pipeline in pipelines:
        instances = by_pipeline.get(pipeline.pk, [])
        states = Counter(instance.state for instance in instances)
        ready = states.pop(InstanceState.READY, 0)
        reasons = sorted({instance.reason for instance in instances if instance.reason})
        desired = sum(group.replicas for group in pipeline.groups.all()) if pipeline.state == "running" else 0
        rows.append(PipelineRow(pipeline, desired, ready, dict(sorted(states.items())), reasons))
    events = list(AuditEntry.objects.order_by("-created_at")[:RECENT_EVENTS])
    return Overview(nodes, rows, events)
