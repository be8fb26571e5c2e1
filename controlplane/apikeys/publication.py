"""API keys to the ingress processes: one signed record per key in etcd (``runtime/api_keys.py``).

A change is published right after its transaction commits, so a revocation reaches every ingress in
milliseconds. When etcd does not answer then, the change is not lost: ``sync`` (a Celery beat task, every
``FLOTILLA_API_KEYS_SYNC_S``) makes etcd hold exactly the records of the database, rewriting any that
differ (a missed change, a replayed or forged record) and deleting any with no key behind it.

Settings: ``ETCD_ENDPOINTS`` (as the reconciler's), and the signing secret in
``FLOTILLA_API_KEYS_SECRET_FILE``, by default ``api-keys.secret`` in the data directory (made on first use).
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import aetcd
from django.conf import settings
from django.db import transaction

from controlplane.apikeys.models import ApiKey
from runtime.api_keys import API_KEYS_PREFIX, SECRET_FILE_VARIABLE, etcd_key, read_secret, secret_in, sign
from runtime.config import env_str
from runtime.errors import DiscoveryUnavailable
from runtime.rate_limited_log import RateLimitedLog
from runtime.settings import parse_etcd_endpoint

log = logging.getLogger(__name__)
_unpublished = RateLimitedLog(log, period_s=60.0)
_RPC_TIMEOUT_S = 3.0
T = TypeVar("T")


@dataclass
class SyncReport:
    written: int = 0
    deleted: int = 0
    unchanged: int = 0


def secret_file() -> Path:
    """Where the signing secret is: ``FLOTILLA_API_KEYS_SECRET_FILE``, else the data directory's."""
    configured = env_str(SECRET_FILE_VARIABLE)
    return Path(configured) if configured else secret_in(Path(settings.DATA_DIR))


def etcd_endpoints() -> list[str]:
    return [part.strip() for part in (env_str("ETCD_ENDPOINTS") or "").split(",") if part.strip()]


def publish_after_commit(key: ApiKey) -> None:
    """Publish ``key``'s record once the current transaction commits; a failure is logged, and the next
    sync publishes it."""
    transaction.on_commit(lambda: publish([key]), robust=True)


def publish(keys: Iterable[ApiKey]) -> bool:
    """Put the records of ``keys`` in etcd now; False (logged) when no etcd is configured or answers."""
    endpoints = etcd_endpoints()
    if not endpoints:
        _unpublished.warning(
            "API keys: ETCD_ENDPOINTS is not set, so no ingress learns of key changes; set it as for the reconciler"
        )
        return False
    secret = read_secret(secret_file())
    values = {etcd_key(key.key_hash): sign(key.record(), key.key_hash, secret) for key in keys}
    try:
        asyncio.run(_apply(endpoints, values, delete=()))
    except DiscoveryUnavailable as exc:
        _unpublished.warning(f"API keys: {exc}; the next sync publishes the change")
        return False
    return True


def sync() -> SyncReport:
    """Make etcd's key records exactly the database's. Raises DiscoveryUnavailable when etcd does not
    answer (the task logs it; the next run tries again)."""
    endpoints = etcd_endpoints()
    if not endpoints:
        return SyncReport()
    secret = read_secret(secret_file())
    wanted = {
        etcd_key(key.key_hash): sign(key.record(), key.key_hash, secret)
        for key in ApiKey.objects.select_related("owner")
    }
    return asyncio.run(_sync(endpoints, wanted))


async def _sync(endpoints: list[str], wanted: dict[str, bytes]) -> SyncReport:
    current = await _each_endpoint(endpoints, _read)
    put = {key: value for key, value in wanted.items() if current.get(key) != value}
    delete = [key for key in current if key not in wanted]
    if put or delete:
        await _apply(endpoints, put, delete)
    return SyncReport(written=len(put), deleted=len(delete), unchanged=len(wanted) - len(put))


async def _apply(endpoints: list[str], put: dict[str, bytes], delete: Iterable[str]) -> None:
    removed = list(delete)

    async def write(client: aetcd.Client) -> None:
        for key, value in put.items():
            await client.put(key.encode(), value)
        for key in removed:
            await client.delete(key.encode())

    await _each_endpoint(endpoints, write)


async def _read(client: aetcd.Client) -> dict[str, bytes]:
    response = await client.get_prefix(API_KEYS_PREFIX.encode())
    return {bytes(kv.key).decode(): bytes(kv.value) for kv in response.kvs}


async def _each_endpoint(endpoints: list[str], call: Callable[[aetcd.Client], Awaitable[T]]) -> T:
    """``call`` with a client of the first endpoint that answers. Raises DiscoveryUnavailable."""
    failures = []
    for host, port in (parse_etcd_endpoint(endpoint) for endpoint in endpoints):
        client = aetcd.Client(host=host, port=port, timeout=_RPC_TIMEOUT_S)
        try:
            return await call(client)
        except aetcd.ClientError as exc:
            failures.append(f"{host}:{port}: {str(exc).rpartition(': ')[2] or exc}")
        finally:
            await client.close()
    raise DiscoveryUnavailable(f"cannot reach etcd to publish API keys ({'; '.join(failures)})")
