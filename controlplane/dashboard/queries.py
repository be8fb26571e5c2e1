"""What the dashboard reads: rows for its tables, each built in a fixed, small number of queries.

Pages read many rows at once and the live bridge reads one at a time; both go through these functions,
so a first render and a live push show the same thing. Nothing here changes state.
"""

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from django.db.models import Count, Exists, OuterRef, Prefetch, Q, QuerySet, Subquery

from controlplane.catalog.models import LanguageModel
from controlplane.deployments.instance_states import LIVE_STATES, InstanceState
from controlplane.deployments.models import Instance, Pipeline, WorkerGroup
from controlplane.fleet.models import Download, Gpu, Node

# Instances that no longer count: the page lists them only on the pipeline's own page.
_GONE = (InstanceState.STOPPED, InstanceState.STOPPING)


@dataclass(frozen=True)
class Rollout:
    """A worker group's rolling update under way (docs/controlplane.md): its live instances still on the
    settings before ``generation`` (old) and those started with them (new), and how many of each serve."""

    role: str
    generation: int
    old: int
    old_ready: int
    new: int
    new_ready: int


@dataclass(frozen=True)
class PipelineRow:
    """A pipeline with what its table row shows: replicas ready over desired, and what holds the rest.

    ``desired`` is the groups' replica count, kept while the pipeline is stopped (start brings them back).
    """

    pipeline: Pipeline
    engines: list[str]
    desired: int
    ready: int
    states: dict[str, int]  # live instances by state, for the ones not ready yet
    reasons: list[str] = field(default_factory=list)  # why instances are pending or failed
    rollouts: list[Rollout] = field(default_factory=list)  # one per group with a rolling update under way

    @property
    def stopped(self) -> bool:
        return self.pipeline.state == Pipeline.State.STOPPED

    @property
    def short(self) -> bool:
        """Fewer replicas ready than wanted, while the pipeline runs (a stopped one wants none running)."""
        return not self.stopped and self.ready < self.desired


# Instances that hold a share of their node's CPUs: live ones of groups with no GPU (dashboard/capacity.py).
_CPU_INSTANCES = Q(state__in=LIVE_STATES, group__gpus_per_replica=0)


def nodes_with_gpus() -> QuerySet[Node]:
    """Nodes with their GPUs in index order, ``placed_instances`` (those not stopped) and ``cpu_instances``, the
    CPU instances placed on each (three queries, however many nodes)."""
    # _CPU_INSTANCES, seen from the nodes.
    on_cpu = Q(instances__state__in=LIVE_STATES, instances__group__gpus_per_replica=0)
    cpu_instances = Count("instances", filter=on_cpu)
    gpus = Prefetch("gpus", queryset=Gpu.objects.order_by("index"))
    # Each links to its instance's page from the node's row.
    placed = Instance.objects.exclude(state=InstanceState.STOPPED).select_related("pipeline", "group").order_by("id")
    instances = Prefetch("instances", queryset=placed, to_attr="placed_instances")
    return Node.objects.prefetch_related(gpus, instances).annotate(cpu_instances=cpu_instances).order_by("name")


def pipelines_with_groups() -> QuerySet[Pipeline]:
    """Pipelines with their model and worker groups, by name."""
    return Pipeline.objects.select_related("model").prefetch_related("groups").order_by("name")


def pipeline_rows(pipelines: Iterable[Pipeline]) -> list[PipelineRow]:
    """One row per pipeline (from ``pipelines_with_groups``), with one more query for all their instances."""
    pipelines = list(pipelines)
    by_pipeline: dict[int, list[Instance]] = {}
    live = Instance.objects.filter(pipeline__in=[p.pk for p in pipelines]).exclude(state__in=_GONE)
    for instance in live.only("pipeline_id", "group_id", "generation", "state", "reason"):
        by_pipeline.setdefault(instance.pipeline_id, []).append(instance)
    rows = []
    for pipeline in pipelines:
        instances = by_pipeline.get(pipeline.pk, [])
        states = Counter(instance.state for instance in instances)
        ready = states.pop(InstanceState.READY, 0)
        reasons = sorted({instance.reason for instance in instances if instance.reason})
        groups = list(pipeline.groups.all())
        desired = sum(group.replicas for group in groups)
        engines = sorted({group.engine for group in groups})
        running = [i for i in instances if i.state in LIVE_STATES]
        rollouts = [rollout for group in groups if (rollout := _rollout(group, running)) is not None]
        rows.append(PipelineRow(pipeline, engines, desired, ready, dict(sorted(states.items())), reasons, rollouts))
    return rows


def _rollout(group: WorkerGroup, running: list[Instance]) -> Rollout | None:
    """``group``'s rolling update, from its pipeline's live instances; None when none of them is outdated."""
    mine = [i for i in running if i.group_id == group.pk]
    old = [i for i in mine if i.generation < group.generation]
    if not old:
        return None
    new = [i for i in mine if i.generation >= group.generation]

    def ready(instances: list[Instance]) -> int:
        return sum(1 for i in instances if i.state == InstanceState.READY)

    return Rollout(group.role, group.generation, len(old), ready(old), len(new), ready(new))


def instances_with_places() -> QuerySet[Instance]:
    """Instances with what their name and row need (pipeline, group, node, ``node_cpu_instances``: the CPU
    instances on their node, and ``group_rolling``: whether their group has a rolling update under way, a live
    instance older than its settings) in the same query."""
    on_node = Instance.objects.filter(_CPU_INSTANCES, node=OuterRef("node")).order_by().values("node")
    count = Subquery(on_node.annotate(count=Count("pk")).values("count"))
    outdated = Instance.objects.filter(
        group=OuterRef("group"), state__in=LIVE_STATES, generation__lt=OuterRef("group__generation")
    )
    return Instance.objects.select_related("pipeline", "group", "node").annotate(
        node_cpu_instances=count, group_rolling=Exists(outdated)
    )


def pipeline_instances(pipeline: Pipeline) -> list[Instance]:
    """The pipeline's instances that are not stopped (stopping ones included), by group and replica."""
    instances = instances_with_places().filter(pipeline=pipeline).exclude(state=InstanceState.STOPPED)
    return list(instances.order_by("group__role", "replica"))


def downloads_with_names() -> QuerySet[Download]:
    """Downloads with their model and node, by model then node."""
    return Download.objects.select_related("node", "model").order_by("model__name", "node__name")


def models_with_pipeline_counts() -> QuerySet[LanguageModel]:
    """The catalog by name, each model with ``pipeline_count``, the pipelines deployed from it (one query)."""
    return LanguageModel.objects.annotate(pipeline_count=Count("pipelines")).order_by("name")
