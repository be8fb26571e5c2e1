"""Writing the audit log: who acts (``Actor``), what a record looked like (``snapshot``), and ``record``.

Every action calls ``record`` inside its transaction, so the entry exists exactly when the change does.
Once the transaction commits, ``entry_committed`` is sent: the dashboard's live updates hook in there.
"""

import datetime
import decimal
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db import models, transaction
from django.dispatch import Signal

from controlplane.audit.models import AuditEntry

JSON = dict[str, Any]

# Sent after the commit of the transaction that wrote an entry; receivers get ``entry=AuditEntry``.
entry_committed = Signal()


@dataclass(frozen=True)
class Actor:
    """Who makes a change: a person (with their user id), a node's agent, or the system itself.

    ``permissions`` are the names of what the person's role allows beyond its rank
    (``controlplane.accounts.models.Permission``); actions that need one check it with ``holds``. Agents and
    the system hold none.
    """

    name: str
    user_id: int | None = None
    permissions: frozenset[str] = frozenset()

    @classmethod
    def person(cls, user: Any) -> "Actor":
        return cls(name=user.get_username(), user_id=user.pk, permissions=frozenset(user.held_permissions()))

    def holds(self, permission: str) -> bool:
        """Whether this actor holds ``permission`` (a ``Permission``'s value)."""
        return permission in self.permissions

    @classmethod
    def agent(cls, node_name: str) -> "Actor":
        return cls(name=f"agent:{node_name}")

    @classmethod
    def system(cls, component: str) -> "Actor":
        return cls(name=f"system:{component}")


def snapshot(row: models.Model, *, exclude: Iterable[str] = ()) -> JSON:
    """The row's own fields as JSON-ready values (foreign keys as ids), for an entry's before/after; without
    the fields its model names in ``audit_exclude`` (derived records that would repeat in every entry)."""
    skipped = set(exclude) | set(getattr(row, "audit_exclude", ()))
    values: JSON = {}
    for field in row._meta.concrete_fields:
        if field.name in skipped:
            continue
        values[field.name] = _json_value(field.value_from_object(row))
    return values


def record(
    actor: Actor,
    action: str,
    target: models.Model,
    *,
    before: JSON | None,
    after: JSON | None,
    target_name: str | None = None,
) -> AuditEntry:
    """Write one audit entry; call it inside the action's transaction (raises if there is none)."""
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError(f"audit.record({action!r}) must run inside the action's transaction")
    entry = AuditEntry.objects.create(
        actor_id=actor.user_id,
        actor_name=actor.name,
        action=action,
        target_type=target._meta.model_name or "",
        target_id=str(target.pk),
        target_name=target_name if target_name is not None else str(target)[:255],
        before=before,
        after=after,
    )
    transaction.on_commit(lambda: entry_committed.send(sender=AuditEntry, entry=entry))
    return entry


def _json_value(value: Any) -> Any:
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal | uuid.UUID):
        return str(value)
    return value
