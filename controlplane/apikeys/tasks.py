"""The Celery beat tasks of API keys: etcd's records kept equal to the database's (``publication.sync``),
and the ingresses' usage counts drained from Redis into the database (``usage.drain``)."""

import logging
from typing import Any

import redis
from celery import shared_task
from redis.exceptions import RedisError

from controlplane.apikeys.publication import sync
from controlplane.apikeys.usage import drain
from controlplane.celery_app import DRAIN_USAGE_TASK, SYNC_API_KEYS_TASK, quota_redis_url
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


@shared_task(name=DRAIN_USAGE_TASK, ignore_result=True)
def drain_usage() -> dict[str, Any] | None:
    """One drain; None (logged) when Redis does not answer: the counts wait there for the next beat."""
    client = redis.Redis.from_url(quota_redis_url(), socket_connect_timeout=2.0, socket_timeout=5.0)
    try:
        report = drain(client)
    except RedisError as exc:
        log.warning("API key usage not drained from Redis: %s; trying again at the next beat", exc)
        return None
    finally:
        client.close()
    return {"batches": report.batches, "rows": report.rows, "skipped": report.skipped}
