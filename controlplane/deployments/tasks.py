"""The control plane's own Celery task: one reconciler pass (beat runs it every FLOTILLA_RECONCILE_S).

Thin on purpose: the pass is ``Reconciler.run_once`` (controlplane/deployments/reconciler.py), which a
lease keeps from overlapping; a pass that finds one running asks it to go once more and returns. It is
never retried: the next beat is the retry.
"""

import logging
from typing import Any

from celery import Task, shared_task

from controlplane.celery_app import RECONCILE_TASK, SYNC_SERVED_NAMES_TASK
from controlplane.deployments import served_names
from controlplane.deployments.dispatch import CeleryDispatcher
from controlplane.deployments.reconciler import Reconciler
from runtime.errors import DiscoveryUnavailable

log = logging.getLogger(__name__)


@shared_task(bind=True, name=RECONCILE_TASK, ignore_result=True)
def reconcile(self: Task) -> dict[str, Any] | None:
    """Run one pass whose tasks for agents go out through the broker of the app that runs it; its
    report, or None when another pass was running."""
    report = Reconciler(CeleryDispatcher(self.app)).run_once()
    return None if report is None else report.as_dict()


@shared_task(name=SYNC_SERVED_NAMES_TASK, ignore_result=True)
def sync_served_names() -> dict[str, Any] | None:
    """Make etcd's served model names the pipelines'; None (logged) when etcd does not answer."""
    try:
        report = served_names.sync()
    except DiscoveryUnavailable as exc:
        log.warning("served model names not synced to the ingress processes: %s; trying again at the next beat", exc)
        return None
    return {"written": report.written, "deleted": report.deleted, "unchanged": report.unchanged}
