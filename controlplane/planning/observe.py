"""From what the loop gathered to the planner's ``Observation``: pure, so that the tests drive it directly.

The loop reads each planned pipeline (``PipelineView``: its groups, their replica counts and the endpoint
instance ids of their live workers), keeps the workers' latest ``WorkerLoad`` per (instance, rank)
(``LoadBook``) and the ingress's traffic over the interval (``IngressStats``, None when the gateway could
not be read). ``observe`` puts them together the way planner/measure.py documents.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from planner.measure import IngressStats, observation, prefix_hit_rate, replica_loads
from planner.observation import GroupObservation, Observation
from planner.settings import Role
from runtime.kv.events import WorkerLoad


@dataclass(frozen=True)
class GroupView:
    """One worker group as the database has it: ``replicas`` is the desired count."""

    role: Role
    replicas: int
    gpus_per_replica: int
    endpoint_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class PipelineView:
    """A running pipeline with planner settings: its served name (the gateway's ``model`` label), its
    targets document and its model's profile document (None: none)."""

    id: int
    name: str
    settings: Mapping[str, object]
    profile: Mapping[str, object] | None
    groups: tuple[GroupView, ...]


@dataclass
class LoadBook:
    """The latest report of each (instance, dp rank), with when it came (the loop's monotonic clock).

    A report older than ``stale_s`` is left out: a worker that stopped reporting (or a NATS that went away)
    must not keep a group's old load alive; without reports load mode holds (planner/load_mode.py).
    """

    stale_s: float
    reports: dict[tuple[int, int], tuple[float, WorkerLoad]] = field(default_factory=dict)

    def add(self, report: WorkerLoad, at: float) -> None:
        self.reports[(report.instance_id, report.dp_rank)] = (at, report)

    def fresh(self, now: float) -> list[WorkerLoad]:
        """The reports younger than ``stale_s``; older ones are forgotten."""
        for key in [key for key, (at, _) in self.reports.items() if now - at > self.stale_s]:
            del self.reports[key]
        return [report for _, report in self.reports.values()]


def observe(
    pipeline: PipelineView,
    reports: Iterable[WorkerLoad],
    stats: IngressStats | None,
    *,
    interval_s: float,
    percentile: float,
    rate_when_unknown: float,
    isl_when_unknown: float | None = None,
) -> Observation:
    """The pipeline's ``Observation``. Without ingress stats (the gateway unreadable) the request rate is
    ``rate_when_unknown`` (the planner's own prediction, so that its history is not taught a false zero)
    and lengths and latencies are unknown. Waiting requests are turned into queued prompt tokens with the
    interval's mean ISL or, when no request finished in it (long requests, or the gateway unreadable),
    ``isl_when_unknown`` (the predicted ISL): without either, a queue of waiting requests would be unknown
    and load mode would hold."""
    mine = [report for report in reports if any(report.instance_id in g.endpoint_ids for g in pipeline.groups)]
    mean_isl = stats.mean_isl if stats is not None and stats.mean_isl is not None else isl_when_unknown
    groups = tuple(
        GroupObservation(
            role=group.role,
            replicas=group.replicas,
            gpus_per_replica=group.gpus_per_replica,
            loads=replica_loads([r for r in mine if r.instance_id in group.endpoint_ids], mean_isl=mean_isl),
        )
        for group in pipeline.groups
    )
    if stats is None:
        return Observation(
            interval_s=interval_s,
            request_rate=rate_when_unknown,
            percentile=percentile,
            prefix_hit_rate=prefix_hit_rate(mine),
            groups=groups,
        )
    return observation(stats, groups, prefix_hit_rate=prefix_hit_rate(mine))
