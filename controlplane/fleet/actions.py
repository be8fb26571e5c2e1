"""Changes to nodes, their GPUs and downloads. Each action runs in one transaction with an audit entry.

Agents call ``register_node``, ``heartbeat`` and ``report_download``; people ``cordon_node`` and
``uncordon_node``; the reconciler ``mark_node_offline``. What runs on the nodes, and moving it off them
(drains, evictions), is the deployments app's (``controlplane.deployments.instances`` and ``.evacuation``),
which builds on ``set_node_flag`` and ``node_snapshot`` here.

Actions that may give the reconciler work (a new or returning node, an uncordon) ask for a pass once they
commit (``controlplane.reconcile_requests``); the periodic pass comes anyway, this only makes it sooner.

A heartbeat that changes only usage figures (memory used, utilisation) is deliberately not audited,
because 200 nodes heartbeating every 5 s would bury the log. Changes of state or of hardware are.
"""

import datetime
import logging
from collections.abc import Sequence
from typing import Any

from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from controlplane.audit.records import JSON, Actor, record, snapshot
from controlplane.catalog.actions import record_model_size
from controlplane.catalog.models import LanguageModel
from controlplane.database import db_now
from controlplane.errors import Conflict, Invalid, Missing
from controlplane.fleet.machines import check_machine, claimed_machine
from controlplane.fleet.models import Download, Gpu, Node
from controlplane.reconcile_requests import request_reconcile
from runtime.fleet_contract.reports import DownloadReport, GpuReport, NodeReport
from runtime.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)
# A broken agent would say the same every heartbeat (every 5 s): once a minute is enough to find it.
_implausible_figures = RateLimitedLog(log, period_s=60.0)

# What a heartbeat that changes only usage figures writes.
_HEARTBEAT_FIELDS = [
    "address", "labels", "cpu_count", "memory_total_bytes", "memory_available_bytes",
    "cpu_utilization_percent", "agent_version", "adapter_failures", "last_heartbeat_at", "updated_at",
]  # fmt: skip
# What a node's audit entries leave out: usage figures and news that change with every heartbeat.
_NOT_AUDITED = (
    "updated_at",
    "last_heartbeat_at",
    "memory_available_bytes",
    "cpu_utilization_percent",
    "adapter_failures",
)
_GPU_USAGE_SQL = "UPDATE {table} SET memory_used_bytes = %s, utilization_percent = %s WHERE id = %s"


def node_snapshot(node: Node, gpus: Sequence[Gpu] | None = None) -> JSON:
    """The node's fields and its GPUs (``gpus``, when already read in index order), for audit entries."""
    values = snapshot(node, exclude=_NOT_AUDITED)
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
    # An engine installed or removed changes what may be placed here: audited, and a reconciler pass asked for.
    new_engines = report.engines is not None and list(report.engines) != node.engines
    if came_back or adopts or new_engines or _hardware(node, gpus) != _reported_hardware(report):
        before = node_snapshot(node, gpus)
        _apply_report(node, report)
        node.state = Node.State.ONLINE
        node.save()
        _sync_gpus(node, report.gpus)
        record(actor, "node.heartbeat", node, before=before, after=node_snapshot(node))
        if came_back or new_engines:
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
    return set_node_flag(actor, node, "cordoned", True, "node.cordon", "is cordoned already")


@transaction.atomic
def uncordon_node(actor: Actor, node: Node) -> Node:
    """Let new instances be placed on the node again. Raises Conflict when it is not cordoned."""
    return set_node_flag(actor, node, "cordoned", False, "node.uncordon", "is not cordoned")


def set_node_flag(actor: Actor, node: Node, flag: str, value: bool, action: str, already: str) -> Node:
    """Set one of the node's intent flags (``cordoned``, ``draining``) to ``value``, audited as ``action``,
    in the caller's transaction. Raises Conflict, saying the node ``already``, when it is set so already."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    if getattr(node, flag) == value:
        raise Conflict(f"node {node.name} {already}")
    before = node_snapshot(node)
    setattr(node, flag, value)
    node.save(update_fields=[flag, "updated_at"])
    record(actor, action, node, before=before, after=node_snapshot(node))
    request_reconcile()
    return node


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
    if download.state == Download.State.DONE and (
        model.size_bytes is None or (model.projector and model.projector_bytes is None)
    ):
        # A finished download tells the catalog sizes nobody gave it, for the memory estimate: the first one, or
        # the first after a projector was added to a model the node already held.
        record_model_size(actor, model, download.bytes_total or None, report.projector_bytes)
    return download


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
    after = node_snapshot(node) | {"reason": f"no heartbeat since {moment(last)}"}
    record(actor, "node.offline", node, before=before, after=after)
    return True


def moment(when: datetime.datetime | None) -> str:
    """``when`` as a person reads it in a reason: UTC, to the second."""
    return "an unknown time" if when is None else when.astimezone(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _apply_report(node: Node, report: NodeReport) -> None:
    node.address = report.address
    node.labels = dict(report.labels)
    node.cpu_count = report.cpu_count
    node.memory_total_bytes = report.memory_total_bytes
    node.memory_available_bytes = report.memory_available_bytes
    node.cpu_utilization_percent = _cpu_utilization(node.name, report.cpu_utilization_percent)
    node.agent_version = report.agent_version
    node.machine_id = claimed_machine(node, report.machine_id)
    if report.engines is not None:
        node.engines = list(report.engines)
    if report.adapter_failures is not None:
        # As the node says; shown only beside its own instances' pipelines (controlplane/dashboard/adapters.py).
        node.adapter_failures = [
            {"pipeline_id": f.pipeline_id, "adapter": f.adapter, "reason": f.reason} for f in report.adapter_failures
        ]
    # The database's time, the clock the reconciler measures silence on. Read, not written as Now(): on
    # SQLite Now() stores text in another format than Django's, and the reconciler's conditional update
    # (mark_node_offline: last_heartbeat_at equal to the value it read) would never match it.
    node.last_heartbeat_at = db_now()


def _cpu_utilization(name: str, percent: float | None) -> float | None:
    """The reported CPU utilisation if it can be one (0..100), else None (not known), logged: a figure the agent
    got wrong is shown as none, and costs the node nothing else."""
    if percent is None or 0.0 <= percent <= 100.0:
        return percent
    _implausible_figures.warning(
        f"node {name} reported a CPU utilisation of {percent:g}%, outside 0..100: recorded as not known"
    )
    return None


def _reported_hardware(report: NodeReport) -> dict[str, Any]:
    """What changes only when the machine does (the audit log records such changes, not usage)."""
    return {
        "cpu_count": report.cpu_count,
        "memory_total_bytes": report.memory_total_bytes,
        "gpus": [[gpu.index, gpu.name, gpu.uuid, gpu.memory_total_bytes] for gpu in sorted(report.gpus, key=_by_index)],
    }


def _by_index(gpu: GpuReport) -> int:
    return gpu.index


def _hardware(node: Node, gpus: Sequence[Gpu]) -> dict[str, Any]:
    """What ``_reported_hardware`` says of a report, of the node as recorded (``gpus`` in index order)."""
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
