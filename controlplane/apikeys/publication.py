"""API keys to the ingress processes: one signed record per key in etcd (``runtime/fleet_contract/api_keys.py``).

A change is published right after its transaction commits, so a revocation reaches every ingress in
milliseconds. When etcd does not answer then, the change is not lost: ``sync`` (a Celery beat task, every
``FLOTILLA_API_KEYS_SYNC_S``) makes etcd hold exactly the records of the database, rewriting any that
differ (a missed change, a replayed or forged record) and deleting any with no key behind it
(controlplane/etcd_records.py does the etcd side).

Settings: ``ETCD_ENDPOINTS`` (as the reconciler's), and the signing secret in
``FLOTILLA_API_KEYS_SECRET_FILE``, by default ``api-keys.secret`` in the data directory (made on first use).
The file is read at each publication and sync, and its first line signs: a new secret put first is used at
once, and the next sync re-signs every record with it (a rotation: docs/controlplane.md).
"""

from collections.abc import Iterable
from pathlib import Path

from django.conf import settings
from django.db import transaction

from controlplane.apikeys.models import ApiKey
from controlplane.etcd_records import SyncReport, etcd_endpoints, put_now, sync_prefix
from runtime.config import env_str
from runtime.fleet_contract.api_keys import (
    API_KEYS_PREFIX,
    SECRET_FILE_VARIABLE,
    etcd_key,
    read_secret,
    secret_in,
    sign,
)


def secret_file() -> Path:
    """Where the signing secret is: ``FLOTILLA_API_KEYS_SECRET_FILE``, else the data directory's."""
    configured = env_str(SECRET_FILE_VARIABLE)
    return Path(configured) if configured else secret_in(Path(settings.DATA_DIR))


def publish_after_commit(*keys: ApiKey) -> None:
    """Publish the records of ``keys`` once the current transaction commits; a failure is logged, and the
    next sync publishes them."""
    if keys:
        transaction.on_commit(lambda: publish(keys), robust=True)


def publish(keys: Iterable[ApiKey]) -> bool:
    """Put the records of ``keys`` in etcd now; False (logged) when no etcd is configured or answers."""
    if not etcd_endpoints():
        return put_now("API keys", {})  # says, once a minute, that nothing reaches the ingresses
    secret = read_secret(secret_file())
    return put_now("API keys", {etcd_key(key.key_hash): sign(key.record(), key.key_hash, secret) for key in keys})


def sync() -> SyncReport:
    """Make etcd's key records exactly the database's. Raises DiscoveryUnavailable when etcd does not
    answer (the task logs it; the next run tries again)."""
    if not etcd_endpoints():
        return SyncReport()
    secret = read_secret(secret_file())
    return sync_prefix(
        API_KEYS_PREFIX,
        lambda: {
            etcd_key(key.key_hash): sign(key.record(), key.key_hash, secret)
            for key in ApiKey.objects.select_related("owner")
        },
    )
