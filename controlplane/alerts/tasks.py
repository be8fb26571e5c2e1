"""The alerts' Celery beat task: one pass of every rule, then notifications (``evaluate.run_pass``)."""

import logging
from typing import Any

from celery import shared_task
from django.db import DatabaseError

from controlplane.alerts.evaluate import run_pass
from controlplane.celery_app import EVALUATE_ALERTS_TASK

log = logging.getLogger(__name__)


@shared_task(name=EVALUATE_ALERTS_TASK, ignore_result=True)
def evaluate_alerts() -> dict[str, Any] | None:
    """One pass; None (logged) when the database does not answer: the next beat tries again."""
    try:
        report = run_pass()
    except DatabaseError as exc:
        log.warning("alerts not evaluated: %s; trying again at the next beat", exc)
        return None
    return {
        "fired": report.fired,
        "resolved": report.resolved,
        "firing": report.firing,
        "failed_rules": report.failed_rules,
        "pruned": report.pruned,
        "errors": report.notified.errors if report.notified else [],
    }
