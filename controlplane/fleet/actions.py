"""Changes to nodes, GPUs, instances and downloads. Each action runs in one transaction with an audit entry.

Agents call ``register_node``, ``heartbeat``, ``report_instance_state`` and ``report_download``; people
call ``drain_node``, ``undrain_node``, ``delete_node`` and ``restart_instance``; the reconciler calls
``mark_node_offline``, ``evacuate_offline_node``, ``restart_failed_instance``, ``give_up_instance`` and
``dispatch_instance``. The instance helpers at the end (``add_instances``, ``stop_instance``,
``transition``) are building blocks for actions here and in deployments; they expect to run inside the
caller's transaction.

Actions that may give the reconciler work (a new or returning node, a drain, a failure, a restart) ask
for a pass once they commit (``request_reconcile``); the periodic pass comes anyway, this only makes it
sooner.

Two kinds of agent news are deliberately not audited, because 200 nodes heartbeating every 5 s would
bury the log: a heartbeat that changes only usage figures (memory used, utilisation), and an instance
report that repeats the state it is in (download progress, a pid). Changes of state or of hardware are.
"""

import datetime
from collections.abc import Callable, Collection, Sequence
from typing import Any

from django.db import IntegrityError, connection, transaction
from django.db.models import F
from django.utils import timezone

from controlplane.audit.records import JSON, Actor, record, snapshot
from controlplane.catalog.actions import record_model_size
from controlplane.catalog.models import LanguageModel
from controlplane.celery_app import request_reconcile
from controlplane.database import db_now
from controlplane.deployments.demand import group_demand
from controlplane.deployments.models import WorkerGroup
from controlplane.deployments.placement import Unschedulable, place
from controlplane.errors import Conflict, Forbidden, Invalid, InvalidTransition, Missing
from controlplane.fleet.inventory import fleet_inventory
from controlplane.fleet.machines import check_machine, claimed_machine
from controlplane.fleet.models import (
    LIVE_STATES,
    PROCESS_STATES,
    Download,
    Gpu,
    Instance,
    InstanceState,
    Node,
    check_transition,
)
from controlplane.fleet.reports import DownloadReport, GpuReport, InstanceReport, NodeReport
from controlplane.live.events import row_changed

# What a heartbeat that changes only usage figures writes.
_HEARTBEAT_FIELDS = [
    "address", "labels", "cpu_count", "memory_total_bytes", "memory_available_bytes",
    "agent_version", "last_heartbeat_at", "updated_at",
]  # fmt: skip
_GPU_USAGE_SQL = "UPDATE {table} SET memory_used_bytes = %s, utilization_percent = %s WHERE id = %s"

# States an agent may report; pending and stopping are the control plane's to set.
AGENT_REPORTABLE_STATES = frozenset(
    {
        InstanceState.DOWNLOADING,
        InstanceState.STARTING,
        InstanceState.READY,
        InstanceState.STOPPED,
        InstanceState.FAILED,
    }
)
AGENT_REPORTABLE_CHOICES = sorted(AGENT_REPORTABLE_STATES)
# A failure after the instance stayed ready this long starts a new streak (restart backoff from the start),
# as Kubernetes forgets a crash loop after ten minutes of running.
HEALTHY_RUN = datetime.timedelta(minutes=10)
# States of an instance on a node that went offline which the reconciler fails (its process is lost).
_LOST_WITH_NODE = frozenset(
    {InstanceState.PENDING, InstanceState.DOWNLOADING, InstanceState.STARTING, InstanceState.READY}
)


def node_snapshot(node: Node, gpus: Sequence[Gpu] | None = None) -> JSON:
    """The node's fields and its GPUs (``gpus``, when already read in index order), for audit entries."""
    values = snapshot(node, exclude=("updated_at", "last_heartbeat_at", "memory_available_bytes"))
    rows = node.gpus.order_by("index") if gpus is None else gpus
    values["gpus"] = [
        {"index": gpu.index, "name": gpu.name, "uuid": gpu.uuid, "memory_total_bytes": gpu.memory_total_bytes}
        for gpu in rows
    ]
    return values


@transaction.atomic
def register_node(actor: Actor, name: str, report: NodeReport) -> Node:
    """Create the node, or update it when its agent registers again (after a restart); it comes online.

    A re-registering node keeps its ``draining`` flag and its instances: the agent resumes them.
    """
    node = Node.objects.select_for_update().filter(name=name).first()
    if node is not None:
        check_machine(node, report.machine_id)  # another machine with this name: OtherMachine (409)
    before = node_snapshot(node) if node else None
    if node is None:
        node = Node(name=name)
    _apply_report(node, report)
    node.state = Node.State.ONLINE
    try:
        node.save()
    except IntegrityError as exc:  # a second registration of a new name raced this one
        raise Conflict(f"node {name!r} registered twice at once; retry") from exc
    _sync_gpus(node, report.gpus)
    record(actor, "node.register", node, before=before, after=node_snapshot(node))
    request_reconcile()  # pending instances may fit on it now
    return node


@transaction.atomic
def heartbeat(actor: Actor, name: str, report: NodeReport) -> Node:
    """Record a node's current inventory; an offline node comes back online.

    Raises Missing when the node never registered (the agent should register first).
    """
    node = Node.objects.select_for_update().filter(name=name).first()
    if node is None:
        raise Missing(f"node {name!r} is not registered; register it first")
    check_machine(node, report.machine_id)
    gpus = list(node.gpus.order_by("index"))  # read once: compared, snapshotted and updated below
    came_back = node.state != Node.State.ONLINE
    adopts = claimed_machine(node, report.machine_id) != node.machine_id  # registered before machine ids
    if came_back or adopts or _hardware(node, gpus) != report.hardware():
        before = node_snapshot(node, gpus)
        _apply_report(node, report)
        node.state = Node.State.ONLINE
        node.save()
        _sync_gpus(node, report.gpus)
        record(actor, "node.heartbeat", node, before=before, after=node_snapshot(node))
        if came_back:
            request_reconcile()
        return node
    # The common case (40 a second from 200 nodes): only usage moved. Two statements, no audit entry;
    # bulk_update's CASE WHEN per field and row was most of a heartbeat's cost (bench/controlplane_api.py).
    _apply_report(node, report)
    node.save(update_fields=_HEARTBEAT_FIELDS)
    by_index = {gpu.index: gpu for gpu in gpus}
    changed = [
        (gpu_report.memory_used_bytes, gpu_report.utilization_percent, by_index[gpu_report.index].pk)
        for gpu_report in report.gpus
        if (by_index[gpu_report.index].memory_used_bytes, by_index[gpu_report.index].utilization_percent)
        != (gpu_report.memory_used_bytes, gpu_report.utilization_percent)
    ]
    if changed:
        with connection.cursor() as cursor:
            cursor.executemany(_GPU_USAGE_SQL.format(table=Gpu._meta.db_table), changed)
    return node


@transaction.atomic
def cordon_node(actor: Actor, node: Node) -> Node:
    """Place nothing new on the node; what runs there stays. Raises Conflict when it is cordoned already."""
    return _set_intent(actor, node, "cordoned", True, "node.cordon", "is cordoned already")


@transaction.atomic
def uncordon_node(actor: Actor, node: Node) -> Node:
    """Let new instances be placed on the node again. Raises Conflict when it is not cordoned."""
    return _set_intent(actor, node, "cordoned", False, "node.uncordon", "is not cordoned")


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
    return _set_intent(actor, node, "draining", False, "node.undrain", "is not draining")


def _set_intent(actor: Actor, node: Node, flag: str, value: bool, action: str, already: str) -> Node:
    node = Node.objects.select_for_update().get(pk=node.pk)
    if getattr(node, flag) == value:
        raise Conflict(f"node {node.name} {already}")
    before = node_snapshot(node)
    setattr(node, flag, value)
    node.save(update_fields=[flag, "updated_at"])
    record(actor, action, node, before=before, after=node_snapshot(node))
    request_reconcile()
    return node


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
def report_instance_state(actor: Actor, node_name: str, instance_id: int, report: InstanceReport) -> Instance:
    """Apply an agent's report about one of its node's instances.

    A report of the state the instance is in already updates the details (pid, endpoint id, progress).
    Reported "stopped" while a restart is requested makes the instance pending again (restarts + 1); an
    instance that fails while being stopped is stopped. Raises Missing for an unknown instance, Forbidden
    when it is not placed on ``node_name``, InvalidTransition when the state cannot follow the current one
    (the agent should then act on the current state, e.g. stop the process of a stopping instance).
    """
    if report.state not in AGENT_REPORTABLE_STATES:
        allowed = ", ".join(sorted(AGENT_REPORTABLE_STATES))
        raise Invalid(f"an agent reports one of {allowed}, not {str(report.state)!r}", field="state")
    instance = Instance.objects.select_related("node", "pipeline", "group").filter(pk=instance_id).first()
    if instance is None:
        raise Missing(f"there is no instance {instance_id}")
    if instance.node is None or instance.node.name != node_name:
        where = f"on node {instance.node.name}" if instance.node else "not placed yet"
        raise Forbidden(f"instance {instance.name} is {where}, not on node {node_name}")
    if report.attempt is not None and report.attempt != instance.restarts:
        raise Conflict(
            f"the report is about attempt {report.attempt} of instance {instance.name}, which is at attempt "
            f"{instance.restarts} now: act on the current attempt (stop a worker of an older one)"
        )
    details = _details(report)
    _check_worker_is_its_own(instance, node_name, details.get("endpoint_instance_id"))
    target = report.state
    if instance.state == InstanceState.STOPPING and target == InstanceState.FAILED:
        target = InstanceState.STOPPED
    if target == InstanceState.STOPPED and instance.state not in (InstanceState.STOPPING, InstanceState.STOPPED):
        # Only the control plane decides that an instance should stop; an agent confirms it.
        raise InvalidTransition(
            f"instance {instance.name} is {instance.state}, not stopping: an agent reports 'stopped' only for an "
            "instance the control plane is stopping (report 'failed', with the reason, for a worker that ended)"
        )
    if target == instance.state:
        if details:
            Instance.objects.filter(pk=instance.pk).update(**details, updated_at=timezone.now())
            for name, value in details.items():
                setattr(instance, name, value)
            row_changed(instance)  # unaudited: the dashboard hears of it here
        return instance
    before = snapshot(instance)
    if target == InstanceState.FAILED:
        details["reason"] = report.reason or "the agent gave no reason"
        details["failure_streak"] = _failure_streak(instance)
        if report.permanent:
            # Retrying cannot fix it (a bad argument, a repository that does not exist): say so once, and
            # let go of the node and GPUs rather than restart it ten times.
            details.update(gave_up=True, node=None, gpu_indexes=[], pid=None)
            details["reason"] = f"gave up on node {node_name}, as retrying cannot fix it: {details['reason']}"
    elif target == InstanceState.STOPPED:
        details["reason"] = report.reason or instance.reason
    else:
        details["reason"] = ""
    if target == InstanceState.STOPPED and instance.restart_requested:
        target = InstanceState.PENDING
        details.update(reason="", pid=None, endpoint_instance_id=None, download_progress=None)
        details.update(restart_requested=False, restarts=instance.restarts + 1, generation=instance.group.generation)
    if target != InstanceState.DOWNLOADING:
        details["download_progress"] = None
    transition(instance, target, **details)
    record(actor, "instance.state", instance, before=before, after=snapshot(instance))
    if target in (InstanceState.PENDING, InstanceState.FAILED):
        request_reconcile()  # start it again (in place, or after its backoff)
    return instance


@transaction.atomic
def report_download(actor: Actor, node_name: str, model_id: int, report: DownloadReport) -> Download:
    """Record a node's download of a model's files; audited when its state changes.

    Raises Missing for an unregistered node or an unknown model, Invalid for an impossible report.
    """
    if report.state not in Download.State.values:
        raise Invalid(
            f"a download is one of {', '.join(Download.State.values)}, not {str(report.state)!r}", field="state"
        )
    if report.bytes_total is not None and report.bytes_done > report.bytes_total:
        raise Invalid("bytes_done is more than bytes_total", field="bytes_done")
    node = Node.objects.filter(name=node_name).first()
    if node is None:
        raise Missing(f"node {node_name!r} is not registered; register it first")
    model = LanguageModel.objects.filter(pk=model_id).first()
    if model is None:
        raise Missing(f"there is no model {model_id}")
    download, created = Download.objects.select_for_update().get_or_create(node=node, model=model)
    before = None if created else snapshot(download)
    old_state = None if created else download.state
    download.state = report.state
    download.bytes_done = report.bytes_done
    download.bytes_total = report.bytes_total
    download.error = report.error if report.state == Download.State.FAILED else ""
    download.save()
    if old_state != download.state:
        record(actor, "download.state", download, before=before, after=snapshot(download))
        if download.state == Download.State.DONE and download.bytes_total:
            # The first finished download tells the catalog a size nobody gave it, for the memory estimate.
            record_model_size(actor, model, download.bytes_total)
    return download


@transaction.atomic
def restart_instance(actor: Actor, instance: Instance) -> Instance:
    """Restart an instance where it is: a running one is stopped and started again, a failed one restarted.

    Raises Conflict when there is nothing to restart (pending, stopping or stopped).
    """
    instance = Instance.objects.select_related("pipeline", "group", "node").get(pk=instance.pk)
    before = snapshot(instance)
    if instance.replacements.filter(state__in=LIVE_STATES).exists():
        raise Conflict(f"instance {instance.name} is being replaced already")
    if _restarts_beside_itself(instance):
        # The group's only replica: its replacement starts first, and it stops once that one is ready.
        (replacement,) = add_instances(actor, instance.group, 1, reason=f"replaces {instance.name}", replaces=instance)
        record(
            actor,
            "instance.restart",
            instance,
            before=before,
            after=snapshot(instance) | {"replacement": replacement.pk},
        )
        request_reconcile()
        return instance
    if instance.state in (InstanceState.DOWNLOADING, InstanceState.STARTING, InstanceState.READY):
        transition(instance, InstanceState.STOPPING, restart_requested=True, reason=f"restart by {actor.name}")
    elif instance.state == InstanceState.FAILED:
        # A person's restart forgives the failures so far: a given-up instance gets a fresh series.
        transition(instance, InstanceState.PENDING, **_fresh_start(instance), failure_streak=0, gave_up=False)
    elif instance.state == InstanceState.STOPPING and instance.restart_requested:
        raise Conflict(f"instance {instance.name} is restarting already")
    else:
        raise Conflict(f"instance {instance.name} is {instance.state}: there is no process to restart")
    record(actor, "instance.restart", instance, before=before, after=snapshot(instance))
    request_reconcile()
    return instance


def _restarts_beside_itself(instance: Instance) -> bool:
    """Whether a restart of ``instance`` starts its replacement first: it is the ready, only replica of its
    group, and a second copy fits somewhere now (else it restarts in place, and the group is down a while)."""
    if instance.state != InstanceState.READY or instance.group.replicas != 1:
        return False
    return not isinstance(place(group_demand(instance.group, 1), fleet_inventory()), Unschedulable)


# The reconciler's actions: each is idempotent and safe against a second pass running at the same time.


@transaction.atomic
def mark_node_offline(actor: Actor, node: Node, silent_since: datetime.datetime) -> bool:
    """Mark an online node offline if its last heartbeat is older than ``silent_since``.

    Returns whether it did: False when a heartbeat arrived meanwhile or another pass got there first.
    """
    node = Node.objects.select_for_update().get(pk=node.pk)
    last = node.last_heartbeat_at
    if node.state != Node.State.ONLINE or last is None or last >= silent_since:
        return False
    before = node_snapshot(node)
    # Conditional on the heartbeat we read: one that lands now keeps the node online.
    updated = Node.objects.filter(pk=node.pk, state=Node.State.ONLINE, last_heartbeat_at=last).update(
        state=Node.State.OFFLINE, updated_at=timezone.now()
    )
    if not updated:
        return False
    node.state = Node.State.OFFLINE
    after = node_snapshot(node) | {"reason": f"no heartbeat since {_moment(last)}"}
    record(actor, "node.offline", node, before=before, after=after)
    return True


@transaction.atomic
def evacuate_offline_node(actor: Actor, node: Node, *, spare_workers: Collection[int] = ()) -> list[Instance]:
    """Give up the processes of an offline node: what ran or was about to start there fails, so that the
    reconciler places it elsewhere; what was stopping is stopped (or pending again, for a restart).

    Instances whose worker id is in ``spare_workers`` (alive in etcd) are left as they are. The node's
    agent, should it come back, stops the workers it still runs that are no longer listed for it.
    Returns the instances changed; those an agent report changed meanwhile are left for the next pass.
    Does nothing for a node that is online again.
    """
    node = Node.objects.select_for_update().get(pk=node.pk)
    if node.state != Node.State.OFFLINE:
        return []
    lost = f"node {node.name} stopped heartbeating at {_moment(node.last_heartbeat_at)}"
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
                transition(instance, InstanceState.PENDING, **_fresh_start(instance), restart_requested=False)
            else:
                transition(instance, InstanceState.STOPPED, reason=f"{lost} while it was stopping", pid=None)
        except Conflict:
            continue
        record(actor, "instance.node_lost", instance, before=before, after=snapshot(instance))
        changed.append(instance)
    return changed


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
def restart_failed_instance(actor: Actor, instance: Instance) -> Instance:
    """Make a failed instance pending again, unplaced, to be placed where it fits now (restarts + 1).

    The reconciler calls it once the instance's backoff has passed. Raises Conflict when the instance
    changed meanwhile, InvalidTransition when it is not failed.
    """
    before = snapshot(instance)
    transition(instance, InstanceState.PENDING, **_fresh_start(instance))
    record(actor, "instance.restart", instance, before=before, after=snapshot(instance))
    return instance


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


@transaction.atomic
def dispatch_instance(
    actor: Actor, instance: Instance, task: str, send: Callable[[], None], now: datetime.datetime
) -> bool:
    """Record that ``task`` goes to the instance's agent now, and ``send`` it, exactly once per claim.

    The claim is a conditional update on the state, node, attempt and last dispatch we read, so of two
    passes that both see the instance due only one sends. ``send`` runs inside the transaction, after the
    claim: if it raises (the broker is unreachable), the claim and its audit entry roll back and the
    next pass tries again. Returns False when another pass (or a state change) got there first.
    """
    claimed = Instance.objects.filter(
        pk=instance.pk,
        state=instance.state,
        node_id=instance.node_id,
        restarts=instance.restarts,
        dispatched_at=instance.dispatched_at,
    ).update(dispatched_at=now, dispatches=F("dispatches") + 1)
    if not claimed:
        return False
    before = snapshot(instance)
    instance.dispatched_at, instance.dispatches = now, instance.dispatches + 1
    after = snapshot(instance) | {"task": task}
    record(actor, "instance.dispatch", instance, before=before, after=after)
    send()
    return True


# Building blocks for actions (here and in deployments); they run inside the caller's transaction.


def add_instances(
    actor: Actor, group: WorkerGroup, count: int, *, reason: str = "", replaces: Instance | None = None
) -> list[Instance]:
    """Add ``count`` pending, unplaced instances to a worker group, with new replica ordinals (each
    replacing ``replaces``, when given)."""
    if count <= 0:
        return []
    WorkerGroup.objects.filter(pk=group.pk).update(next_replica=F("next_replica") + count)
    group.refresh_from_db(fields=["next_replica"])
    first = group.next_replica - count
    instances = [
        Instance(
            pipeline_id=group.pipeline_id,
            group=group,
            replica=first + offset,
            reason=reason,
            replaces=replaces,
            generation=group.generation,
        )
        for offset in range(count)
    ]
    for instance in instances:
        instance.save()
        record(actor, "instance.create", instance, before=None, after=snapshot(instance))
    return instances


def stop_instance(actor: Actor, instance: Instance, reason: str) -> Instance:
    """Stop a live instance: ``stopping`` when its agent may run a process for it, else ``stopped`` at once.

    A pending instance that was placed may already be starting on its node, so it goes through stopping
    too; a failed one and an unplaced one have no process.
    """
    before = snapshot(instance)
    has_process = instance.state in PROCESS_STATES or (
        instance.state == InstanceState.PENDING and instance.node_id is not None
    )
    target = InstanceState.STOPPING if has_process else InstanceState.STOPPED
    transition(instance, target, reason=reason, restart_requested=False)
    record(actor, "instance.stop", instance, before=before, after=snapshot(instance))
    return instance


def transition(instance: Instance, new_state: str, **fields: Any) -> None:
    """Move an instance to ``new_state`` (with other field changes) if nobody moved it meanwhile.

    The update is conditional on the state we read, so two racing changes cannot both apply. Raises
    InvalidTransition when the state machine forbids the move, Conflict when the row changed meanwhile.
    """
    check_transition(instance.state, new_state)
    now = timezone.now()
    # A new state needs its own task sent (or none): what was dispatched for the old one no longer counts.
    changes = {
        "state": new_state,
        "state_changed_at": now,
        "updated_at": now,
        "dispatched_at": None,
        "dispatches": 0,
        **fields,
    }
    updated = Instance.objects.filter(pk=instance.pk, state=instance.state).update(**changes)
    if updated != 1:
        current = Instance.objects.filter(pk=instance.pk).values_list("state", flat=True).first()
        raise Conflict(f"instance {instance.pk} changed meanwhile (it is {current or 'gone'} now); retry")
    for name, value in changes.items():
        setattr(instance, name, value)


def _failure_streak(instance: Instance) -> int:
    """The instance's failure count once this failure is counted: 1 after a long healthy run."""
    healthy = instance.state == InstanceState.READY and timezone.now() - instance.state_changed_at >= HEALTHY_RUN
    return 1 if healthy else instance.failure_streak + 1


def _fresh_start(instance: Instance) -> dict[str, Any]:
    """The fields of an instance that starts again from scratch, to be placed anew."""
    return {
        "node": None,
        "gpu_indexes": [],
        "pid": None,
        "endpoint_instance_id": None,
        "download_progress": None,
        "restarts": instance.restarts + 1,
        "reason": "",
        "generation": instance.group.generation,  # it starts with its group's configuration as it is now
    }


def _moment(when: datetime.datetime | None) -> str:
    return "an unknown time" if when is None else when.astimezone(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _live_instances_on(node: Node) -> list[Instance]:
    return list(
        Instance.objects.select_related("pipeline", "group").filter(node=node, state__in=LIVE_STATES).order_by("id")
    )


def _check_worker_is_its_own(instance: Instance, node_name: str, worker_id: int | None) -> None:
    """Raise Forbidden when ``worker_id`` is another instance's worker: an agent names only the workers it
    started (else it could get another node's worker fenced as its own when its node is evicted)."""
    if worker_id is None or worker_id == instance.endpoint_instance_id:
        return
    owner = Instance.objects.filter(endpoint_instance_id=worker_id).exclude(pk=instance.pk).first()
    if owner is not None:
        raise Forbidden(
            f"worker {worker_id:x} is instance {owner.name}'s, not {instance.name}'s: node {node_name} may report "
            "only the workers it started"
        )


def _details(report: InstanceReport) -> dict[str, Any]:
    details: dict[str, Any] = {}
    if report.pid is not None:
        details["pid"] = report.pid
    if report.endpoint_instance_id is not None:
        details["endpoint_instance_id"] = report.endpoint_instance_id
    if report.download_progress is not None and report.state == InstanceState.DOWNLOADING:
        details["download_progress"] = report.download_progress
    return details


def _apply_report(node: Node, report: NodeReport) -> None:
    node.address = report.address
    node.labels = dict(report.labels)
    node.cpu_count = report.cpu_count
    node.memory_total_bytes = report.memory_total_bytes
    node.memory_available_bytes = report.memory_available_bytes
    node.agent_version = report.agent_version
    node.machine_id = claimed_machine(node, report.machine_id)
    # The database's time, the clock the reconciler measures silence on. Read, not written as Now(): on
    # SQLite Now() stores text in another format than Django's, and the reconciler's conditional update
    # (mark_node_offline: last_heartbeat_at equal to the value it read) would never match it.
    node.last_heartbeat_at = db_now()


def _hardware(node: Node, gpus: Sequence[Gpu]) -> dict[str, Any]:
    """What NodeReport.hardware() says of a report, of the node as recorded (``gpus`` in index order)."""
    return {
        "cpu_count": node.cpu_count,
        "memory_total_bytes": node.memory_total_bytes,
        "gpus": [[gpu.index, gpu.name, gpu.uuid, gpu.memory_total_bytes] for gpu in gpus],
    }


def _sync_gpus(node: Node, reports: Sequence[GpuReport]) -> None:
    """Make the node's GPU rows match the report: update by index, add new ones, drop vanished ones."""
    existing = {gpu.index: gpu for gpu in node.gpus.all()}
    reported = {report.index: report for report in reports}
    changed: list[Gpu] = []
    for index, report in reported.items():
        gpu = existing.get(index)
        if gpu is None:
            Gpu.objects.create(node=node, **_gpu_fields(report))
            continue
        fields = _gpu_fields(report)
        if any(getattr(gpu, name) != value for name, value in fields.items()):
            for name, value in fields.items():
                setattr(gpu, name, value)
            changed.append(gpu)
    if changed:
        Gpu.objects.bulk_update(
            changed, ["name", "uuid", "memory_total_bytes", "memory_used_bytes", "utilization_percent"]
        )
    vanished = set(existing) - set(reported)
    if vanished:
        node.gpus.filter(index__in=vanished).delete()


def _gpu_fields(report: GpuReport) -> dict[str, Any]:
    return {
        "index": report.index,
        "name": report.name,
        "uuid": report.uuid,
        "memory_total_bytes": report.memory_total_bytes,
        "memory_used_bytes": report.memory_used_bytes,
        "utilization_percent": report.utilization_percent,
    }
