"""The planner's one action: record an interval's decisions for a pipeline, and act on those that act.

Acting is the operator's own scale action (``scale_pipeline``), as ``system:planner``, with the decision's
reason in its audit entry. Before a scale-up it asks placement whether the new replicas fit: when they do
not, the decision is recorded as not acted, with placement's reason, rather than adding instances that
would wait unplaced (the planner's cooldown then keeps it from asking again at once). A decision made on a
count that changed meanwhile (a person scaled the group) is not acted on either: the next interval decides
on the new count.
"""

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

from django.db import transaction

from controlplane.audit.records import Actor
from controlplane.deployments.demand import group_demand
from controlplane.deployments.inventory import fleet_inventory
from controlplane.deployments.models import Pipeline
from controlplane.deployments.pipelines import scale_pipeline
from controlplane.deployments.placement import Unschedulable, place
from controlplane.errors import Conflict, Invalid
from controlplane.live.events import planner_changed
from controlplane.planning.models import KEEP_PER_PIPELINE, PlannerDecision
from planner.decision import Decision

ACTOR = Actor.system("planner")


@dataclass(frozen=True)
class Seen:
    """What the planner saw for the pipeline this interval, kept with each of its decisions."""

    percentile: float | None = None
    ttft_s: float | None = None
    itl_s: float | None = None
    predicted_rate: float | None = None
    predicted_isl: float | None = None
    predicted_osl: float | None = None


@transaction.atomic
def apply_decisions(
    pipeline_id: int, decisions: Sequence[Decision], seen: Seen, at: datetime.datetime, *, actor: Actor = ACTOR
) -> list[PlannerDecision]:
    """Act on each decision that ``acts``, then record them all (pruning the pipeline's oldest beyond
    ``KEEP_PER_PIPELINE``); the pipeline's page hears of it after commit. Returns the rows written ([] when
    the pipeline was deleted or stopped meanwhile)."""
    pipeline = Pipeline.objects.select_for_update().filter(pk=pipeline_id, state=Pipeline.State.RUNNING).first()
    if pipeline is None:
        return []
    rows = []
    for decision in decisions:
        acted, note = _act(actor, pipeline, decision) if decision.acts else (False, "")
        rows.append(
            PlannerDecision(
                pipeline=pipeline,
                role=decision.role,
                at=at,
                current=decision.current,
                desired=decision.desired,
                wanted=decision.wanted,
                mode=decision.mode,
                bound=decision.bound or "",
                advisory=decision.advisory,
                acted=acted,
                reason=decision.reason + note,
                percentile=seen.percentile,
                ttft_s=seen.ttft_s,
                itl_s=seen.itl_s,
                predicted_rate=seen.predicted_rate,
                predicted_isl=seen.predicted_isl,
                predicted_osl=seen.predicted_osl,
            )
        )
    PlannerDecision.objects.bulk_create(rows)
    _prune(pipeline_id)
    transaction.on_commit(lambda: planner_changed(pipeline_id), robust=True)
    return rows


def _act(actor: Actor, pipeline: Pipeline, decision: Decision) -> tuple[bool, str]:
    """Scale the decision's group; (False, why not) when it must not or cannot be."""
    group = pipeline.groups.select_related("pipeline__model").filter(role=decision.role).first()
    if group is None:
        return False, f"; not acted: the pipeline has no {decision.role} group any more"
    if group.replicas != decision.current:
        return False, f"; not acted: the group was changed to {group.replicas} replicas meanwhile"
    if decision.change > 0:
        fits = place(group_demand(group, decision.change), fleet_inventory())
        if isinstance(fits, Unschedulable):
            return False, f"; not acted: {decision.change} more replica(s) cannot be placed: {fits.reason}"
    try:
        scale_pipeline(
            actor,
            pipeline,
            decision.desired,
            decision.role,
            reason=decision.reason,
            stop_first=decision.drain_instances,
        )
    except (Invalid, Conflict) as exc:
        return False, f"; not acted: {exc}"
    return True, ""


def _prune(pipeline_id: int) -> None:
    # Rows are written in time order by one planner at a time, so ids order them as well as ``at`` does.
    oldest_kept = (
        PlannerDecision.objects.filter(pipeline_id=pipeline_id)
        .order_by("-id")
        .values_list("id", flat=True)[KEEP_PER_PIPELINE - 1 : KEEP_PER_PIPELINE]
    )
    cutoff = next(iter(oldest_kept), None)
    if cutoff is not None:
        PlannerDecision.objects.filter(pipeline_id=pipeline_id, id__lt=cutoff).delete()
