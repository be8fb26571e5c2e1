"""The Celery tasks of batches: a slice of one batch's run (``runner.run_slice``), queued again while the
batch needs more, and the upkeep that starts batches whose runner is gone (a restart of the control plane
mid-batch, a task lost with the broker) and ends batches past their window."""

import logging

from celery import shared_task
from django.db.models import Q
from django.utils import timezone

from controlplane.batches.models import Batch
from controlplane.batches.runner import run_slice
from controlplane.celery_app import BATCH_UPKEEP_TASK, RUN_BATCH_TASK, send_batch_slice

log = logging.getLogger(__name__)


@shared_task(name=RUN_BATCH_TASK, ignore_result=True)
def run_batch(batch_id: str) -> None:
    if run_slice(batch_id):
        send_batch_slice(batch_id)


@shared_task(name=BATCH_UPKEEP_TASK, ignore_result=True)
def batch_upkeep() -> int:
    """Queue a slice for every running batch that no runner holds; returns how many."""
    now = timezone.now()
    orphans = list(
        Batch.objects.filter(status__in=Batch.RUNNING)
        .filter(Q(runner_until__isnull=True) | Q(runner_until__lt=now))
        .values_list("pk", flat=True)
    )
    for batch_id in orphans:
        send_batch_slice(batch_id)
    if orphans:
        log.info("batches: queued a slice for %d batch(es) no runner held", len(orphans))
    return len(orphans)
