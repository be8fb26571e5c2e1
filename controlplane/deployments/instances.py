"""An instance's life as actions: created, placed and stopped, moved from state to state as its agent
reports, and restarted by a person.

``report_instance_state`` is the agent's and ``restart_instance`` a person's; each runs in one transaction
with an audit entry. ``add_instances``, ``stop_instance`` and ``transition`` are the building blocks of
every action that changes instances (here, in ``pipelines``, ``evacuation`` and ``upkeep``): they run in
the caller's transaction. ``transition`` is the only writer of an instance's state, and it writes only
the moves ``instance_states.TRANSITIONS`` allows, conditional on the state it read.

An agent's report that repeats the state the instance is in (download progress, a pid) is deliberately not
audited: every node sends such news all the time. Changes of state are.
"""

import datetime
from collections.abc import Sequence
from typing import Any

from django.db import transaction
from django.db.models import F

from controlplane.audit.records import Actor, record, snapshot
from controlplane.database import db_now
from controlplane.deployments.demand import group_demand
from controlplane.deployments.instance_events import download_milestone, exit_details, record_event
from controlplane.deployments.instance_states import LIVE_STATES, PROCESS_STATES, InstanceState, check_transition
from controlplane.deployments.inventory import fleet_inventory
from controlplane.deployments.models import Instance, InstanceEvent, WorkerGroup
from controlplane.deployments.placement import Unschedulable, place
from controlplane.errors import Conflict, Forbidden, Invalid, InvalidTransition, Missing
from controlplane.live.events import row_changed
from controlplane.reconcile_requests import request_reconcile
from runtime.fleet_contract.reports import InstanceReport

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
    if report.incarnation and report.incarnation != instance.incarnation:
        raise Conflict(
            f"the report is about incarnation {report.incarnation} of instance id {instance.pk}, which is "
            f"{instance.name} (incarnation {instance.incarnation}) now: its worker is another instance's, stop it"
        )
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
            milestone = download_milestone(instance.download_progress, details.get("download_progress"))
            if milestone is not None:
                record_event(instance, InstanceEvent.Kind.DOWNLOAD, f"downloaded {milestone:.0%} of the model")
            Instance.objects.filter(pk=instance.pk).update(**details, updated_at=db_now())  # a stall is measured on it
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
        transition(instance, InstanceState.PENDING, **fresh_start(instance), failure_streak=0, gave_up=False)
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


def add_instances(
    actor: Actor,
    group: WorkerGroup,
    count: int,
    *,
    reason: str = "",
    replaces: Instance | None = None,
    succeeds: Sequence[Instance] = (),
) -> list[Instance]:
    """Add ``count`` pending, unplaced instances to a worker group, with new replica ordinals (each
    replacing ``replaces``, when given).

    A new row that takes another's place runs the same replica again, so it carries that replica's restarts
    plus one (``prior_restarts``): the row it replaces, or the n-th of ``succeeds`` for the n-th new row
    (a stopped pipeline's instances, when it starts again).
    """
    if count <= 0:
        return []
    WorkerGroup.objects.filter(pk=group.pk).update(next_replica=F("next_replica") + count)
    group.refresh_from_db(fields=["next_replica"])
    first = group.next_replica - count
    predecessors: list[Instance | None] = [replaces] * count if replaces is not None else list(succeeds)[:count]
    predecessors += [None] * (count - len(predecessors))
    instances = [
        Instance(
            pipeline_id=group.pipeline_id,
            group=group,
            replica=first + offset,
            reason=reason,
            replaces=replaces,
            previous=predecessor,
            generation=group.generation,
            prior_restarts=predecessor.replica_restarts + 1 if predecessor is not None else 0,
        )
        for offset, predecessor in enumerate(predecessors)
    ]
    for instance, predecessor in zip(instances, predecessors, strict=True):
        instance.save()
        record(actor, "instance.create", instance, before=None, after=snapshot(instance))
        record_event(instance, InstanceEvent.Kind.STATE, reason or "created", after=instance.state)
        if predecessor is not None:
            # The replica starts again in a new row: a restart of it, as the Restarts column counts it.
            why = f"{reason or 'started again'} (the replica ran as {predecessor.name} before)"
            record_event(instance, InstanceEvent.Kind.RESTART, why, data={"previous": predecessor.pk})
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
    now = db_now()  # the reconciler's deadlines and backoffs are measured from it, on the database's clock
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
    _record_transition(instance, new_state, fields)
    for name, value in changes.items():
        setattr(instance, name, value)


def _record_transition(instance: Instance, new_state: str, fields: dict[str, Any]) -> None:
    """The timeline's events of a move ``transition`` just wrote (``instance`` still holds the old values):
    the change of state, and a restart when the move starts a new attempt."""
    reason = str(fields.get("reason", instance.reason) or "")
    data = exit_details(reason) if new_state == InstanceState.FAILED else {}
    record_event(instance, InstanceEvent.Kind.STATE, reason, before=instance.state, after=new_state, data=data)
    restarts = fields.get("restarts")
    if isinstance(restarts, int) and restarts > instance.restarts:
        # Why it restarts is why the attempt before ended: its failure (with the exit code) or a person's restart.
        why = instance.reason or f"restarted from {instance.state}"
        record_event(instance, InstanceEvent.Kind.RESTART, why, data={"attempt": restarts, **exit_details(why)})


def _failure_streak(instance: Instance) -> int:
    """The instance's failure count once this failure is counted: 1 after a long healthy run."""
    healthy = instance.state == InstanceState.READY and db_now() - instance.state_changed_at >= HEALTHY_RUN
    return 1 if healthy else instance.failure_streak + 1


def fresh_start(instance: Instance) -> dict[str, Any]:
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
