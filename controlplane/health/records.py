"""``record_pass``: the reconciler says a pass finished (one call at the end of ``Reconciler.run_once``)."""

import bisect
import logging
import time
from datetime import timedelta

from django.db import DatabaseError, IntegrityError, transaction
from django.db.models import DateTimeField, DurationField, ExpressionWrapper, Value
from django.db.models.functions import Now

from controlplane.health.models import PASS_BUCKETS_S, ReconcilerPass

log = logging.getLogger(__name__)


def record_pass(name: str, started_monotonic: float, summary: str) -> None:
    """Keep that reconciler ``name``'s pass, begun at ``time.monotonic()`` = ``started_monotonic``, has just
    finished with ``summary``: its end is the database's ``Now()``, its start that less its duration.

    Never raises: a pass that did its work is not undone because its record could not be written (the
    health check then reports the reconciler late, which is what an operator needs to look at anyway).
    """
    duration_s = max(time.monotonic() - started_monotonic, 0.0)
    try:
        _record(name, duration_s, summary)
    except DatabaseError as exc:
        log.warning("the reconciler's pass could not be recorded for the health check: %s", exc)


def _record(name: str, duration_s: float, summary: str) -> None:
    started = ExpressionWrapper(
        Now() - Value(timedelta(seconds=duration_s), output_field=DurationField()), output_field=DateTimeField()
    )
    bucket = bisect.bisect_left(PASS_BUCKETS_S, duration_s)  # the first bound the duration does not exceed
    fields = {"started_at": started, "finished_at": Now(), "duration_s": duration_s, "summary": summary}
    # Passes do not overlap (the reconciler's lease), but a pass of another process may record as this
    # one does: the histogram's read-modify-write holds the row.
    for _ in range(2):
        with transaction.atomic():
            row = ReconcilerPass.objects.select_for_update().filter(name=name).first()
            if row is not None:
                counts = row.histogram()
                counts[bucket] += 1
                ReconcilerPass.objects.filter(pk=row.pk).update(
                    passes=row.passes + 1,
                    duration_sum_s=row.duration_sum_s + duration_s,
                    bucket_counts=counts,
                    **fields,
                )
                return
        counts = [0] * (len(PASS_BUCKETS_S) + 1)
        counts[bucket] += 1
        try:
            with transaction.atomic():
                ReconcilerPass.objects.create(
                    name=name, passes=1, duration_sum_s=duration_s, bucket_counts=counts, **fields
                )
            return
        except IntegrityError:
            continue  # another process created it first: update it
