"""The Celery beat task that keeps etcd's API key records equal to the database's (``publication.sync``)."""

import logging
from typing import Any

from celery import shared_task

from controlplane.apikeys.publication import sync
from controlplane.celery_app import SYNC_API_KEYS_TASK
from runtime.errors import DiscoveryUnavailable

log = logging.getLogger(__name__)


@shared_task(name=SYNC_API_KEYS_TASK, ignore_result=True)
def sync_api_keys() -> dict[str, Any] | None:
    """One sync; None (logged) when etcd does not answer: the next beat tries again."""
    try:
        report = sync()
    except DiscoveryUnavailable as exc:
        log.warning("API keys not synced to the ingress processes: %s; trying again at the next beat", exc)
        return None
    if report.written or report.deleted:
        log.info("API keys synced: %d record(s) written, %d deleted", report.written, report.deleted)
    return {"written": report.written, "deleted": report.deleted, "unchanged": report.unchanged}
