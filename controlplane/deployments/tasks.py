"""The control plane's own Celery task: one reconciler pass (beat runs it every FLOTILLA_RECONCILE_S).

Thin on purpose: the pass is ``Reconciler.run_once`` (controlplane/deployments/reconciler.py), which a
lease keeps from overlapping; a pass that finds one running asks it to go once more and returns. It is
never retried: the next beat is the retry.
"""

from typing import Any

from celery import Task, shared_task

from controlplane.celery_app import RECONCILE_TASK
from controlplane.deployments.dispatch import CeleryDispatcher
from controlplane.deployments.reconciler import Reconciler


@shared_task(bind=True, name=RECONCILE_TASK, ignore_result=True)
def reconcile(self: Task) -> dict[str, Any] | None:
    """Run one pass whose tasks for agents go out through the broker of the app that runs it; its
    report, or None when another pass was running."""
    report = Reconciler(CeleryDispatcher(self.app)).run_once()
    return None if report is None else report.as_dict()
