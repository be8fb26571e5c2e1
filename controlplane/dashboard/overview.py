"""What the overview page shows, read from the records in a few queries (no state changes here)."""

from dataclasses import dataclass

from controlplane.audit.models import AuditEntry
from controlplane.dashboard import queries
from controlplane.dashboard.fleet_health import FleetHealth, fleet_health
from controlplane.dashboard.queries import PipelineRow
from controlplane.fleet.models import Node

RECENT_EVENTS = 15


@dataclass(frozen=True)
class Overview:
    nodes: list[Node]
    pipelines: list[PipelineRow]
    events: list[AuditEntry] | None  # None: the person may not read the audit log
    health: FleetHealth


def overview(*, with_events: bool) -> Overview:
    """Nodes with their GPUs, pipelines with ready/desired replicas and what holds the rest, the fleet's health,
    and (when ``with_events``) the latest audit entries."""
    nodes = list(queries.nodes_with_gpus())
    rows = queries.pipeline_rows(queries.pipelines_with_groups())
    events = list(AuditEntry.objects.order_by("-created_at", "-id")[:RECENT_EVENTS]) if with_events else None
    return Overview(nodes, rows, events, fleet_health(rows))
