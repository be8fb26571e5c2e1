"""Silences, made and expired by people: each change in one transaction with its audit entry."""

import datetime

from django.db import transaction
from django.utils import timezone

from controlplane.alerts.models import Rule, Silence
from controlplane.audit.records import Actor, record, snapshot
from controlplane.errors import Conflict, Invalid

#: The longest a silence may last: a forgotten one must not hide alerts for ever.
MAX_SILENCE = datetime.timedelta(days=30)


@transaction.atomic
def create_silence(
    actor: Actor,
    *,
    rule: str,
    subject: str,
    ends_at: datetime.datetime,
    comment: str,
    now: datetime.datetime | None = None,
) -> Silence:
    """A silence of ``rule`` and/or ``subject`` until ``ends_at``. Raises Invalid, naming the field, for a
    silence that matches everything, an unknown rule, an end not in the future or too far, or no comment."""
    now = now or timezone.now()
    rule, subject, comment = rule.strip(), subject.strip(), comment.strip()
    if rule and rule not in Rule.values:
        raise Invalid(f"unknown rule {rule[:40]!r}: one of {', '.join(Rule.values)}", field="rule")
    if not rule and not subject:
        raise Invalid(
            "a silence needs a rule or a subject (or both): one matching everything is not allowed", field="rule"
        )
    if len(subject) > 255:
        raise Invalid("the subject is longer than 255 characters", field="subject")
    if ends_at <= now:
        raise Invalid("the silence must end in the future", field="ends_at")
    if ends_at - now > MAX_SILENCE:
        raise Invalid(f"a silence may last {MAX_SILENCE.days} days at most", field="ends_at")
    if not comment:
        raise Invalid("say why (a comment) so that others know", field="comment")
    silence = Silence.objects.create(
        rule=rule,
        subject=subject,
        ends_at=ends_at,
        comment=comment,
        created_by_id=actor.user_id,
        created_by_name=actor.name,
    )
    record(actor, "silence.create", silence, before=None, after=snapshot(silence))
    return silence


@transaction.atomic
def expire_silence(actor: Actor, silence: Silence, now: datetime.datetime | None = None) -> Silence:
    """End ``silence`` now (matching alerts are notified again from the next pass). Raises Conflict when it
    has ended already."""
    now = now or timezone.now()
    locked = Silence.objects.select_for_update().get(pk=silence.pk)
    if locked.ends_at <= now:
        raise Conflict(f"this silence ended already, at {locked.ends_at:%Y-%m-%d %H:%M:%S} UTC")
    before = snapshot(locked)
    locked.ends_at = now
    locked.save(update_fields=["ends_at"])
    record(actor, "silence.expire", locked, before=before, after=snapshot(locked))
    return locked
