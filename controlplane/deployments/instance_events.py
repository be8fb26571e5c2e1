"""An instance's timeline: ``InstanceEvent`` rows written where the instance changes, read by its page.

``record_event`` runs in the caller's transaction (an event exists exactly when its change committed) and
keeps the latest ``KEEP_EVENTS`` of the instance, pruning in the same transaction, so a crash-looping
instance cannot grow the table. The writers are the few places an instance changes: ``instances.transition``
(every change of state, and the restart it may be), ``instances.add_instances`` (a replica's new row),
``upkeep.place_pending_instances`` (placed, unschedulable), ``upkeep.dispatch_instance`` (a task sent) and
an agent's download progress (milestones only, ``download_milestone``).

``restart_history`` reads the restarts of a replica across its rows (``Instance.previous``).
"""

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from controlplane.database import db_now
from controlplane.deployments.models import Instance, InstanceEvent

#: Events kept per instance: the oldest go as new ones come.
KEEP_EVENTS = 200
#: Download progress is a timeline event when it crosses one of these fractions (not at every report).
DOWNLOAD_MILESTONES = (0.25, 0.5, 0.75, 1.0)
#: How far back a replica's rows are followed for its restart history.
MAX_CHAIN = 50
# The agent's words for how a worker ended (agent/workers/processes.py).
_EXIT_CODE = re.compile(r"exit code (-?\d+)")
_SIGNAL = re.compile(r"killed by signal (\d+)")


def record_event(
    instance: Instance,
    kind: str,
    message: str,
    *,
    before: str = "",
    after: str = "",
    data: dict[str, Any] | None = None,
) -> InstanceEvent:
    """Add an event to ``instance``'s timeline (in the caller's transaction) and drop those past KEEP_EVENTS."""
    event = InstanceEvent.objects.create(
        instance_id=instance.pk, at=db_now(), kind=kind, message=message, before=before, after=after, data=data or {}
    )
    stale = InstanceEvent.objects.filter(instance_id=instance.pk).order_by("-at", "-id")[KEEP_EVENTS:]
    stale_ids = list(stale.values_list("pk", flat=True))
    if stale_ids:
        InstanceEvent.objects.filter(pk__in=stale_ids).delete()
    return event


def exit_details(reason: str) -> dict[str, int]:
    """The exit code or signal a failure reason names (``{"exit_code": 1}``, ``{"signal": 9}``), else {}."""
    details: dict[str, int] = {}
    if match := _EXIT_CODE.search(reason):
        details["exit_code"] = int(match.group(1))
    if match := _SIGNAL.search(reason):
        details["signal"] = int(match.group(1))
    return details


def download_milestone(before: float | None, after: float | None) -> float | None:
    """The highest milestone that progress crossed going from ``before`` to ``after``, or None."""
    if after is None:
        return None
    crossed = [mark for mark in DOWNLOAD_MILESTONES if (before or 0.0) < mark <= after]
    return crossed[-1] if crossed else None


@dataclass(frozen=True)
class Restart:
    """One restart of a replica: when, why, and how its previous attempt ended where known."""

    at: datetime
    instance_name: str
    why: str
    exit_code: int | None = None
    signal: int | None = None


def replica_rows(instance: Instance) -> list[Instance]:
    """The rows that ran ``instance``'s replica, newest first (itself, then each ``previous``)."""
    rows = [instance]
    seen = {instance.pk}
    current = instance
    while current.previous_id is not None and len(rows) < MAX_CHAIN:
        previous = Instance.objects.select_related("pipeline", "group").filter(pk=current.previous_id).first()
        if previous is None or previous.pk in seen:
            break
        rows.append(previous)
        seen.add(previous.pk)
        current = previous
    return rows


def restart_history(instance: Instance) -> list[Restart]:
    """The restarts of ``instance``'s replica, newest first, from the restart events of all its rows (those
    pruned from a long timeline, or made before timelines were kept, are not listed: the count still is)."""
    rows = {row.pk: row for row in replica_rows(instance)}
    events: Iterable[InstanceEvent] = InstanceEvent.objects.filter(
        instance_id__in=list(rows), kind=InstanceEvent.Kind.RESTART
    ).order_by("-at", "-id")
    return [
        Restart(
            at=event.at,
            instance_name=rows[event.instance_id].name,
            why=event.message,
            exit_code=_int_or_none(event.data.get("exit_code")),
            signal=_int_or_none(event.data.get("signal")),
        )
        for event in events
    ]


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
