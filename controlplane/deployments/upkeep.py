"""The reconciler's steps on instances, as actions: place what is pending, keep each group at its replica
count, roll out configuration updates one replica at a time, send agents their tasks exactly once, fail
what is overdue, restart what failed and give up on what keeps failing.

Each step is idempotent and safe against a second pass running at the same time (conditional updates on
what it read, row locks where it counts); the reconciler (``reconciler.py``) decides when each runs.
"""

import datetime
from collections.abc import Callable
from typing import Any

from django.db import transaction
from django.db.models import Count, F, Q
from django.utils import timezone

from controlplane.audit.records import Actor, record, snapshot
from controlplane.deployments.demand import group_demand
from controlplane.deployments.instance_events import record_event
from controlplane.deployments.instance_states import LIVE_STATES, InstanceState
from controlplane.deployments.instances import add_instances, fresh_start, stop_instance, transition
from controlplane.deployments.inventory import fleet_inventory
from controlplane.deployments.models import Instance, InstanceEvent, Pipeline, WorkerGroup
from controlplane.deployments.placement import Placement, Unschedulable, place
from controlplane.deployments.placement_record import decision_record
from controlplane.errors import Conflict
from controlplane.fleet.models import Node


@transaction.atomic
def place_pending_instances(
    actor: Actor, pipeline: Pipeline | None = None
) -> list[tuple[WorkerGroup, Placement | Unschedulable]]:
    """Place the unplaced pending instances of running pipelines (or of one), group by group.

    Placed instances get their node and GPU indexes (still pending: dispatching them is the reconciler's
    job); the rest keep a reason a person can act on. Audited per instance placed, and when an
    instance's reason changes. Returns each group's placement result.

    Two placements at once (two reconciler passes, a drain's check) would each read the same free GPU
    and both fill it: the node rows are locked first, in one order, so that they run one after the other
    on PostgreSQL (SQLite's single writer serializes them anyway).
    """
    list(Node.objects.select_for_update().order_by("pk").values_list("pk", flat=True))
    groups = WorkerGroup.objects.select_related("pipeline__model").filter(
        pipeline__state=Pipeline.State.RUNNING,
        instances__state=InstanceState.PENDING,
        instances__node__isnull=True,
    )
    if pipeline is not None:
        groups = groups.filter(pipeline=pipeline)
    results: list[tuple[WorkerGroup, Placement | Unschedulable]] = []
    for group in groups.distinct().order_by("pipeline__created_at", "role"):
        waiting = list(group.instances.filter(state=InstanceState.PENDING, node__isnull=True).order_by("replica"))
        # The inventory is read again for each group, so that it includes the groups placed before.
        demand, inventory = group_demand(group, len(waiting)), fleet_inventory()
        result = place(demand, inventory)
        chosen = result.replicas if isinstance(result, Placement) else result.placed
        nodes = {node.name: node for node in Node.objects.filter(name__in={r.node for r in chosen})}
        for instance, where in zip(waiting, chosen, strict=False):
            before = snapshot(instance)
            decision = decision_record(demand, inventory, where)
            claimed = Instance.objects.filter(pk=instance.pk, state=InstanceState.PENDING, node__isnull=True).update(
                node=nodes[where.node], gpu_indexes=list(where.gpu_indexes), reason="", placement=decision
            )
            if claimed:
                instance.refresh_from_db()
                if group.gpus_per_replica == 0:
                    _note_cpu_sharing(instance, nodes[where.node])
                record(actor, "instance.place", instance, before=before, after=snapshot(instance))
                gpus = f" GPUs {', '.join(map(str, where.gpu_indexes))}" if where.gpu_indexes else " (CPU)"
                record_event(
                    instance,
                    InstanceEvent.Kind.PLACED,
                    f"placed on {where.node}{gpus}",
                    data={"node": where.node, "gpus": list(where.gpu_indexes)},
                )
        if isinstance(result, Unschedulable):
            for instance in waiting[len(chosen) :]:
                if instance.reason != result.reason or not instance.placement:
                    before = snapshot(instance)
                    decision = decision_record(demand, inventory, None, result.reason)
                    Instance.objects.filter(pk=instance.pk, node__isnull=True).update(
                        reason=result.reason, placement=decision
                    )
                    instance.reason, instance.placement = result.reason, decision
                    record(actor, "instance.unschedulable", instance, before=before, after=snapshot(instance))
                    record_event(instance, InstanceEvent.Kind.UNSCHEDULABLE, result.reason)
        results.append((group, result))
    return results


def _note_cpu_sharing(instance: Instance, node: Node) -> None:
    """Add to a CPU instance's placement record how many CPU instances its node now runs on how many CPUs:
    placement does not refuse oversubscription, the instance page warns of it (controlplane/dashboard/capacity.py)."""
    cpu_instances = Instance.objects.filter(node=node, state__in=LIVE_STATES, group__gpus_per_replica=0).count()
    instance.placement = {**instance.placement, "cpu": {"instances": cpu_instances, "cpus": node.cpu_count}}
    Instance.objects.filter(pk=instance.pk).update(placement=instance.placement)


# An instance restarting in place is stopping for a moment, but still one of its group's replicas.
_COUNTS_AS_REPLICA = Q(state__in=LIVE_STATES) | Q(state=InstanceState.STOPPING, restart_requested=True)


def keep_replica_counts(actor: Actor) -> list[Instance]:
    """Add instances to the groups of running pipelines that have fewer replicas than their replica count
    (a replica lost some way no action replaced: stopped by its node's eviction while it was being
    restarted, or a row removed by hand). Never stops any: scaling down is a person's action.

    Returns the instances added, unplaced and pending.
    """
    replicas = Count("instances", filter=Q(instances__in=Instance.objects.filter(_COUNTS_AS_REPLICA)))
    short = (
        WorkerGroup.objects.filter(pipeline__state=Pipeline.State.RUNNING)
        .annotate(counted=replicas)
        .filter(counted__lt=F("replicas"))
        .values_list("pk", flat=True)
    )
    added: list[Instance] = []
    for group_id in list(short):
        added += _fill_group(actor, group_id)
    return added


@transaction.atomic
def _fill_group(actor: Actor, group_id: int) -> list[Instance]:
    """Top up one group, counted again under its row lock (a scale or a second pass may have come first)."""
    group = WorkerGroup.objects.select_for_update().select_related("pipeline").get(pk=group_id)
    if group.pipeline.state != Pipeline.State.RUNNING:
        return []
    missing = group.replicas - group.instances.filter(_COUNTS_AS_REPLICA).count()
    return add_instances(actor, group, missing, reason="replaces a lost replica")


def roll_out_updates(actor: Actor) -> int:
    """One step of each rolling update: in every group of a running pipeline with instances of an older
    generation and no replacement of one on its way, one outdated instance is replaced.

    A ready one gets a replacement and stops once that one is ready (``retire_replaced_instances``); when
    no node has room for the replacement beside it, it restarts in place instead (its group runs one short
    meanwhile). One that does not serve yet stops at once, and the replica count brings a new one.
    Returns how many instances were replaced or restarted.
    """
    outdated = Instance.objects.filter(state__in=LIVE_STATES, generation__lt=F("group__generation"))
    groups = (
        WorkerGroup.objects.filter(pipeline__state=Pipeline.State.RUNNING, instances__in=outdated)
        .distinct()
        .values_list("pk", flat=True)
    )
    return sum(_roll_one(actor, group_id) for group_id in list(groups))


@transaction.atomic
def _roll_one(actor: Actor, group_id: int) -> int:
    group = WorkerGroup.objects.select_for_update().select_related("pipeline").get(pk=group_id)
    instances = group.instances.select_related("pipeline", "group", "node")
    in_flight = instances.filter(replaces__isnull=False, state__in=LIVE_STATES - {InstanceState.READY})
    if in_flight.filter(generation=group.generation).exists():
        return 0  # one at a time: the replacement under way goes first
    outdated = list(
        instances.filter(state__in=LIVE_STATES, generation__lt=group.generation)
        .exclude(replacements__state__in=LIVE_STATES)
        .order_by("replica")
    )
    if not outdated:
        return 0
    instance = min(outdated, key=lambda i: i.state == InstanceState.READY)  # those that do not serve first
    reason = f"updated to generation {group.generation}"
    if instance.state != InstanceState.READY:
        stop_instance(actor, instance, reason)
        add_instances(actor, group, 1, reason=f"replaces {instance.name} ({reason})", replaces=instance)
    elif isinstance(place(group_demand(group, 1), fleet_inventory()), Unschedulable):
        before = snapshot(instance)
        transition(instance, InstanceState.STOPPING, restart_requested=True, generation=group.generation, reason=reason)
        record(actor, "instance.restart", instance, before=before, after=snapshot(instance))
    else:
        add_instances(actor, group, 1, reason=f"replaces {instance.name} ({reason})", replaces=instance)
    return 1


@transaction.atomic
def fail_overdue_instance(actor: Actor, instance: Instance, reason: str) -> bool:
    """Fail an instance that stayed too long in a state its agent should have moved it out of (a start nobody
    took, a download that stopped moving, a worker that never became ready), as a failure of its own.

    Returns False when its state changed meanwhile (a report came in).
    """
    before = snapshot(instance)
    try:
        transition(instance, InstanceState.FAILED, reason=reason, failure_streak=instance.failure_streak + 1)
    except Conflict:
        return False
    record(actor, "instance.overdue", instance, before=before, after=snapshot(instance))
    return True


@transaction.atomic
def end_unconfirmed_stop(actor: Actor, instance: Instance, reason: str) -> bool:
    """Take a stop its agent never confirmed as done: the instance is stopped, or, when it was stopping to
    restart, pending again and unplaced (restarts + 1) so that it is placed anew. Returns False when its state
    changed meanwhile (a report came in). The caller fences its worker once this has committed."""
    before = snapshot(instance)
    try:
        if instance.restart_requested:
            transition(instance, InstanceState.PENDING, **fresh_start(instance), restart_requested=False)
        else:
            transition(instance, InstanceState.STOPPED, reason=reason, pid=None)
    except Conflict:
        return False
    record(actor, "instance.stop_unconfirmed", instance, before=before, after=snapshot(instance) | {"why": reason})
    return True


@transaction.atomic
def refuse_start(actor: Actor, instance: Instance, reason: str) -> bool:
    """Fail a pending instance for good that cannot be started as its settings stand (its model's engine
    args changed since deploy so that its host KV tier cannot be sized): retrying cannot fix it, so its
    node and GPUs are let go. Returns False when its state changed meanwhile."""
    before = snapshot(instance)
    try:
        transition(instance, InstanceState.FAILED, reason=reason, gave_up=True, node=None, gpu_indexes=[], pid=None)
    except Conflict:
        return False
    record(actor, "instance.refused", instance, before=before, after=snapshot(instance))
    return True


@transaction.atomic
def restart_failed_instance(actor: Actor, instance: Instance) -> Instance:
    """Make a failed instance pending again, unplaced, to be placed where it fits now (restarts + 1).

    The reconciler calls it once the instance's backoff has passed. Raises Conflict when the instance
    changed meanwhile, InvalidTransition when it is not failed.
    """
    before = snapshot(instance)
    transition(instance, InstanceState.PENDING, **fresh_start(instance))
    record(actor, "instance.restart", instance, before=before, after=snapshot(instance))
    return instance


@transaction.atomic
def give_up_instance(actor: Actor, instance: Instance, restarts: int) -> bool:
    """Leave a failed instance failed for good, its reason saying so; a person's restart revives it.

    Its node and GPUs are let go (the reason names the node), so that what it reserved serves others; a
    restart places it anew. Returns False when it is not failed any more, or was given up already.
    """
    if instance.state != InstanceState.FAILED or instance.gave_up:
        return False
    before = snapshot(instance)
    where = f" on node {instance.node.name}" if instance.node is not None else ""
    reason = f"gave up after {restarts} restarts{where}: {instance.reason}"
    updated = Instance.objects.filter(pk=instance.pk, state=InstanceState.FAILED, gave_up=False).update(
        reason=reason, gave_up=True, node=None, gpu_indexes=[], updated_at=timezone.now()
    )
    if not updated:
        return False
    instance.reason, instance.gave_up, instance.node, instance.gpu_indexes = reason, True, None, []
    record(actor, "instance.give_up", instance, before=before, after=snapshot(instance))
    return True


def dispatch_instance(
    actor: Actor,
    instance: Instance,
    task: str,
    send: Callable[[], None],
    now: datetime.datetime,
    *,
    spec: dict[str, Any] | None = None,
) -> bool:
    """Claim the instance's dispatch, ``send`` the task, then record it: of two passes that both see the
    instance due, only the one whose claim lands sends.

    The claim is a conditional update on the state, node, attempt and dispatches we read, committed
    before ``send`` runs: no database lock is held while the broker is asked (a frozen Redis would hold
    SQLite's write lock for as long as the publish waits, and every other write would fail meanwhile). If
    ``send`` raises (the broker is unreachable), the claim is taken back, if it is still ours, nothing is
    recorded, and the next pass tries again. A process that dies between the claim and the send leaves a
    claim with no task: the instance is due again after the task's resend interval, as after a lost task.
    ``spec``, the worker spec a start sends (as JSON), is kept with the timeline's dispatch event.
    Returns False when another pass (or a state change) got there first.
    """
    before = snapshot(instance)
    dispatches = instance.dispatches + 1
    with transaction.atomic():
        claimed = Instance.objects.filter(
            pk=instance.pk,
            state=instance.state,
            node_id=instance.node_id,
            restarts=instance.restarts,
            dispatched_at=instance.dispatched_at,
            dispatches=instance.dispatches,
        ).update(dispatched_at=now, dispatches=dispatches)
    if not claimed:
        return False
    try:
        send()
    except BaseException:
        with transaction.atomic():
            Instance.objects.filter(pk=instance.pk, dispatched_at=now, dispatches=dispatches).update(
                dispatched_at=instance.dispatched_at, dispatches=instance.dispatches
            )
        raise
    instance.dispatched_at, instance.dispatches = now, dispatches
    with transaction.atomic():
        record(actor, "instance.dispatch", instance, before=before, after=snapshot(instance) | {"task": task})
        node = instance.node.name if instance.node else "its node"
        verb = task.rsplit(".", 1)[-1].removesuffix("_instance")  # "start" or "stop"
        record_event(
            instance,
            InstanceEvent.Kind.DISPATCH,
            f"{verb} sent to {node} (send {dispatches})",
            data={"task": task} | ({"spec": spec} if spec is not None else {}),
        )
    return True
