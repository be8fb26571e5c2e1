"""Records the control plane keeps in etcd for the ingress processes (API keys, served model names).

Each kind lives under its own prefix. A change is put right after its transaction commits (``put_now``),
so ingresses hear of it in milliseconds; a periodic ``sync_prefix`` makes the prefix hold exactly what the
database says, which repairs a change made while etcd was down and undoes anything put there by another
hand. Settings: ``ETCD_ENDPOINTS`` (as the reconciler's).
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import aetcd

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


def etcd_endpoints() -> list[str]:
    return [part.strip() for part in (env_str("ETCD_ENDPOINTS") or "").split(",") if part.strip()]


def put_now(what: str, put: dict[str, bytes], delete: Iterable[str] = ()) -> bool:
    """Put ``put`` and delete ``delete`` in etcd now; False (logged, once a minute) when no etcd is configured
    or none answers: the next sync does it. ``what`` names the records in the log."""
    endpoints = etcd_endpoints()
    if not endpoints:
        _unpublished.warning(
            f"{what}: ETCD_ENDPOINTS is not set, so no ingress learns of the change; set it as for the reconciler"
        )
        return False
    try:
        asyncio.run(_apply(endpoints, put, delete))
    except DiscoveryUnavailable as exc:
        _unpublished.warning(f"{what}: {exc}; the next sync publishes the change")
        return False
    return True


def sync_prefix(prefix: str, wanted: dict[str, bytes]) -> SyncReport:
    """Make the keys under ``prefix`` exactly ``wanted``. Raises DiscoveryUnavailable when etcd does not
    answer; does nothing when no etcd is configured."""
    endpoints = etcd_endpoints()
    if not endpoints:
        return SyncReport()
    return asyncio.run(_sync(endpoints, prefix, wanted))


async def _sync(endpoints: list[str], prefix: str, wanted: dict[str, bytes]) -> SyncReport:
    async def read(client: aetcd.Client) -> dict[str, bytes]:
        response = await client.get_prefix(prefix.encode())
        return {bytes(kv.key).decode(): bytes(kv.value) for kv in response.kvs}

    current = await _each_endpoint(endpoints, read)
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
    raise DiscoveryUnavailable(f"cannot reach etcd to publish to the ingresses ({'; '.join(failures)})")
