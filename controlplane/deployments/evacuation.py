"""Moving instances off nodes: a person's drain (replacements ready before the old ones stop), the
deletion of an empty node, and the reconciler's evacuation of a node that went silent past its eviction
time. Each runs in one transaction with an audit entry; ``retire_replaced_instances`` stops each
instance whose replacement is ready, one transaction each.
"""

from collections.abc import Collection, Sequence

from django.db import transaction

from controlplane.audit.records import Actor, record, snapshot
from controlplane.deployments.demand import group_demand
from controlplane.deployments.instance_states import LIVE_STATES, PROCESS_STATES, InstanceState
from controlplane.deployments.instances import add_instances, fresh_start, stop_instance, transition
from controlplane.deployments.inventory import fleet_inventory
from controlplane.deployments.models import Instance
from controlplane.deployments.placement import Unschedulable, place
from controlplane.errors import Conflict
from controlplane.fleet.actions import moment, node_snapshot, set_node_flag
from controlplane.fleet.models import Node
from controlplane.reconcile_requests import request_reconcile

# States of an instance on a node that went offline which the reconciler fails (its process is lost).
_LOST_WITH_NODE = frozenset(
    {InstanceState.PENDING, InstanceState.DOWNLOADING, InstanceState.STARTING, InstanceState.READY}
)


@transaction.atomic
def drain_node(actor: Actor, node: Node, *, force: bool = False) -> Node:
    """Place nothing new on the node and move its instances off it without dropping a replica.

    Each live instance there gets a replacement in its group (pending, unplaced, ``replaces`` it), which the
    reconciler places on another node; a ready instance is stopped once its replacement is ready
    (``retire_replaced_instances``), one that does not serve yet is stopped at once. When some
    replacement fits on no other node now, the drain is refused with the pipelines it would stop, unless
    ``force``: then every instance there stops at once and the replacements wait for room. Raises Conflict
    when the node is draining already, or for the stranded pipelines.
    """
    node = Node.objects.select_for_update().get(pk=node.pk)
    if node.draining:
        raise Conflict(f"node {node.name} is draining already")
    before = node_snapshot(node)
    node.draining = True
    node.save(update_fields=["draining", "updated_at"])  # first: the placement check below must skip it
    live = _live_instances_on(node)
    if not force and (stranded := _stranded(live)):
        raise Conflict(
            f"draining {node.name} would stop {stranded}; add room on another node, or drain with force to "
            "stop them anyway"
        )
    moved = []
    for instance in live:
        (replacement,) = add_instances(actor, instance.group, 1, reason=f"replaces {instance.name}", replaces=instance)
        if force or instance.state != InstanceState.READY:
            stop_instance(actor, instance, f"node {node.name} was drained by {actor.name}")
        moved.append({"instance": instance.pk, "replacement": replacement.pk, "stopped_at_once": instance.state})
    after = node_snapshot(node) | {"moved_instances": moved, "force": force}
    record(actor, "node.drain", node, before=before, after=after)
    request_reconcile()
    return node


@transaction.atomic
def undrain_node(actor: Actor, node: Node) -> Node:
    """Let new instances be placed on the node again (replacements under way go on). Raises Conflict when
    it is not draining."""
    return set_node_flag(actor, node, "draining", False, "node.undrain", "is not draining")


def _stranded(instances: Sequence[Instance]) -> str:
    """The pipelines whose replacements for ``instances`` fit on no schedulable node now, each with why;
    "" when every one fits somewhere."""
    per_group: dict[int, list[Instance]] = {}
    for instance in instances:
        per_group.setdefault(instance.group_id, []).append(instance)
    stranded = []
    for members in per_group.values():
        group = members[0].group
        result = place(group_demand(group, len(members)), fleet_inventory())
        if isinstance(result, Unschedulable):
            stranded.append(f"pipeline {group.pipeline.name} ({result.reason})")
    return "; ".join(stranded)


@transaction.atomic
def delete_node(actor: Actor, node: Node) -> None:
    """Forget a node (its agent would register it again). Raises Conflict while instances are on it."""
    busy = Instance.objects.filter(node=node, state__in=LIVE_STATES | PROCESS_STATES).count()
    if busy:
        raise Conflict(f"node {node.name} has {busy} instance(s) that are not stopped; drain it first")
    record(actor, "node.delete", node, before=node_snapshot(node), after=None)
    node.delete()


@transaction.atomic
def evacuate_offline_node(actor: Actor, node: Node, *, spare_workers: Collection[int] = ()) -> list[Instance]:
    """Give up the processes of an offline node: what ran or was about to start there fails, so that the
    reconciler places it elsewhere; what was stopping is stopped (or pending again, for a restart).

    Instances whose worker id is in ``spare_workers`` (alive, by their signed claims in etcd) are left as
    they are. The node's agent, should it come back, stops the workers it still runs that are no longer
    listed for it.
    Returns the instances changed; those an agent report changed meanwhile are left for the next pass.
    Does nothing for a node that is online again.
    """
    node = Node.objects.select_for_update().get(pk=node.pk)
    if node.state != Node.State.OFFLINE:
        return []
    lost = f"node {node.name} stopped heartbeating at {moment(node.last_heartbeat_at)}"
    changed = []
    on_node = Instance.objects.select_related("pipeline", "group").filter(
        node=node, state__in=_LOST_WITH_NODE | {InstanceState.STOPPING}
    )
    for instance in on_node.order_by("id"):
        if instance.endpoint_instance_id is not None and instance.endpoint_instance_id in spare_workers:
            continue
        before = snapshot(instance)
        try:
            if instance.state != InstanceState.STOPPING:
                transition(instance, InstanceState.FAILED, reason=lost, pid=None, download_progress=None)
            elif instance.restart_requested:
                transition(instance, InstanceState.PENDING, **fresh_start(instance), restart_requested=False)
            else:
                transition(instance, InstanceState.STOPPED, reason=f"{lost} while it was stopping", pid=None)
        except Conflict:
            continue
        record(actor, "instance.node_lost", instance, before=before, after=snapshot(instance))
        changed.append(instance)
    return changed


def retire_replaced_instances(actor: Actor) -> int:
    """Stop each instance whose replacement is ready (a drain, a restart that keeps its only replica up),
    and each failed one whose replacement is under way (restarting it would make one replica two).

    Returns how many were stopped; one that changed meanwhile is left for the next pass.
    """
    ready = Instance.objects.filter(replacements__state=InstanceState.READY).exclude(
        state__in=[InstanceState.STOPPING, InstanceState.STOPPED]
    )
    failed = Instance.objects.filter(state=InstanceState.FAILED, replacements__state__in=LIVE_STATES)
    retired = 0
    for instance in (ready | failed).distinct().select_related("pipeline", "group").order_by("id"):
        replacement = instance.replacements.select_related("node", "pipeline", "group").order_by("-id").first()
        assert replacement is not None
        where = f" on node {replacement.node.name}" if replacement.node is not None else ""
        try:
            with transaction.atomic():
                stop_instance(actor, instance, f"replaced by {replacement.name}{where}")
        except Conflict:
            continue
        retired += 1
    return retired


def _live_instances_on(node: Node) -> list[Instance]:
    return list(
        Instance.objects.select_related("pipeline", "group").filter(node=node, state__in=LIVE_STATES).order_by("id")
    )
