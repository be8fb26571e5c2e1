"""Usage of API keys: the ingress processes' counts, drained from Redis into ``KeyUsage`` rows.

Each ingress adds its counts to a Redis hash per UTC day (``flotilla:usage:<day>``, fields
``<key id>\\t<model>\\t<what>``; frontend_gateway/access/quotas.py). ``drain`` (a Celery beat task, every
``FLOTILLA_USAGE_DRAIN_S``) claims each hash by renaming it to a unique name (ingresses then start a new
one), adds its counts to the rows of its key, model and day, and deletes it. The claimed name is stored
with the counts in one transaction, so a batch is added once even when its deletion failed; a batch
claimed by a drain that died is finished by the next.

Settings: ``FLOTILLA_QUOTA_REDIS_URL``, the Redis the ingresses count in (default: the broker's).
"""

import logging
import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import date, timedelta
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from controlplane.apikeys.models import ApiKey, KeyUsage, UsageBatch

log = logging.getLogger(__name__)

USAGE_PREFIX = "flotilla:usage:"  # as frontend_gateway/access/quotas.py writes it
CLAIMED_PREFIX = "flotilla:usage-claimed:"
FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors")
_KEEP_BATCH_NAMES = timedelta(days=7)


@dataclass
class DrainReport:
    batches: int = 0
    rows: int = 0
    skipped: int = 0  # counts of keys the database does not have


def drain(redis: Any) -> DrainReport:
    """Move every day's counts from ``redis`` (a ``redis.Redis``) into the database."""
    for name in list(redis.scan_iter(match=f"{USAGE_PREFIX}*")):
        day = name.decode().removeprefix(USAGE_PREFIX)
        claimed = f"{CLAIMED_PREFIX}{day}:{uuid.uuid4().hex}"
        try:
            redis.rename(name, claimed)
        except Exception as exc:  # gone meanwhile (another drain took it): nothing to do
            log.debug("usage batch %s not claimed: %s", name, exc)
    report = DrainReport()
    for name in list(redis.scan_iter(match=f"{CLAIMED_PREFIX}*")):
        claimed = name.decode()
        counts = redis.hgetall(name)
        rows, skipped = _add(claimed, counts)
        report.batches += 1
        report.rows += rows
        report.skipped += skipped
        redis.delete(name)
    UsageBatch.objects.filter(drained_at__lt=timezone.now() - _KEEP_BATCH_NAMES).delete()
    return report


@transaction.atomic
def _add(claimed: str, counts: dict[bytes, bytes]) -> tuple[int, int]:
    """Add one claimed batch, unless it was added already; returns (rows changed, counts skipped)."""
    if UsageBatch.objects.filter(name=claimed).exists():
        return 0, 0
    UsageBatch.objects.create(name=claimed)
    day = date.fromisoformat(claimed.removeprefix(CLAIMED_PREFIX).split(":", 1)[0])
    per_row: dict[tuple[int, str], dict[str, int]] = defaultdict(dict)
    skipped = 0
    for field, value in counts.items():
        try:
            key_id, model, what = field.decode().split("\t")
            per_row[(int(key_id), model[:200])][what] = int(value)
        except ValueError:
            skipped += 1
            continue
    known = set(ApiKey.objects.filter(pk__in={key_id for key_id, _ in per_row}).values_list("pk", flat=True))
    changed = 0
    for (key_id, model), values in per_row.items():
        if key_id not in known:
            skipped += 1
            continue
        increments = {what: values.get(what, 0) for what in FIELDS}
        row, created = KeyUsage.objects.get_or_create(key_id=key_id, model=model, day=day, defaults=increments)
        if not created:
            KeyUsage.objects.filter(pk=row.pk).update(**{what: F(what) + n for what, n in increments.items()})
        changed += 1
    if skipped:
        log.warning("usage batch %s: %d count(s) of unknown keys or malformed fields skipped", claimed, skipped)
    return changed, skipped
