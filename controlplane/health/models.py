"""What the health checks and metrics read that nothing else keeps: the reconciler's last pass.

Passes run in the Celery worker; health and metrics are asked of the web processes. Only the database is
shared by both, so the pass is kept here, not in a process's memory.
"""

from typing import ClassVar

from django.db import models

# Upper bounds (seconds) of the pass-duration histogram's buckets; +Inf is implied.
PASS_BUCKETS_S: tuple[float, ...] = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ReconcilerPass(models.Model):
    """The last finished pass of one reconciler (``name`` is its lease's name), and every pass's duration
    so far as a histogram: ``bucket_counts[i]`` passes took at most ``PASS_BUCKETS_S[i]`` seconds and more
    than the bucket before (the last entry: longer than every bound), ``duration_sum_s`` their total.

    Its times are the database's (``Now()``), the one clock that ages are measured against. Not audited:
    it is a record of the loop's liveness, not desired state.
    """

    name = models.CharField(max_length=64, unique=True)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField()
    duration_s = models.FloatField()
    summary = models.TextField(blank=True)
    passes = models.BigIntegerField(default=0)
    duration_sum_s = models.FloatField(default=0.0)
    bucket_counts = models.JSONField(default=list)

    class Meta:
        ordering: ClassVar = ["name"]

    def histogram(self) -> list[int]:
        """``bucket_counts`` with one entry per bound and one past them (zeros for a row of another bucket set)."""
        size = len(PASS_BUCKETS_S) + 1
        counts = self.bucket_counts
        return list(counts) if isinstance(counts, list) and len(counts) == size else [0] * size

    def __str__(self) -> str:
        return f"{self.name}: last pass finished {self.finished_at.isoformat()} after {self.duration_s:.3f} s"
