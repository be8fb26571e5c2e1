"""Records the control plane keeps in etcd for the ingress processes (API keys, served model names).

Each kind lives under its own prefix. A change is put right after its transaction commits (``put_now``),
so ingresses hear of it in milliseconds; a periodic ``sync_prefix`` makes the prefix hold exactly what the
database says, which repairs a change made while etcd was down and undoes anything put there by another
hand. Settings: ``ETCD_ENDPOINTS`` (as the reconciler's).

A sync never undoes a change published while it runs. It reads etcd first, then the database: a record put
before its etcd read was committed before its database read, which then has it. Each of its writes and
deletions is an etcd transaction that applies only while the record is still at the revision it read, so a
record put after the read (a key made a moment ago, not in the sync's older reading of the database) is left
for the next sync to judge, not deleted.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
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
    #: Records changed by someone else between the sync's read and its write: left as they are now.
    raced: list[str] = field(default_factory=list)


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


def read_prefix(prefix: str) -> dict[str, bytes] | None:
    """The records under ``prefix`` now; None when no etcd is configured or none answers (logged at debug: a
    page that shows them says it could not)."""
    endpoints = etcd_endpoints()
    if not endpoints:
        return None
    try:
        records = asyncio.run(_each_endpoint(endpoints, lambda client: _read(client, prefix)))
    except DiscoveryUnavailable as exc:
        log.debug("reading %s: %s", prefix, exc)
        return None
    return {key: value for key, (value, _) in records.items()}


def sync_prefix(prefix: str, read_wanted: Callable[[], dict[str, bytes]]) -> SyncReport:
    """Make the keys under ``prefix`` what ``read_wanted()`` (the database's records, read after etcd's) says.
    Raises DiscoveryUnavailable when etcd does not answer; does nothing when no etcd is configured."""
    endpoints = etcd_endpoints()
    if not endpoints:
        return SyncReport()
    current = asyncio.run(_each_endpoint(endpoints, lambda client: _read(client, prefix)))
    wanted = read_wanted()
    return asyncio.run(_converge(endpoints, current, wanted))


async def _read(client: aetcd.Client, prefix: str) -> dict[str, tuple[bytes, int]]:
    """Each record under ``prefix``: its value and the revision that last changed it."""
    response = await client.get_prefix(prefix.encode())
    return {bytes(kv.key).decode(): (bytes(kv.value), int(kv.mod_revision)) for kv in response.kvs}


async def _converge(
    endpoints: list[str], current: dict[str, tuple[bytes, int]], wanted: dict[str, bytes]
) -> SyncReport:
    """Put what differs and delete what is not wanted, each only if the record is still as read (revision 0:
    absent)."""
    put = {key: value for key, value in wanted.items() if current.get(key, (None, 0))[0] != value}
    delete = [key for key in current if key not in wanted]
    report = SyncReport(unchanged=len(wanted) - len(put))

    async def write(client: aetcd.Client) -> None:
        for key, value in put.items():
            if await _if_unchanged(
                client, key, current.get(key, (b"", 0))[1], client.transactions.put(key.encode(), value)
            ):
                report.written += 1
            else:
                report.raced.append(key)
        for key in delete:
            if await _if_unchanged(client, key, current[key][1], client.transactions.delete(key.encode())):
                report.deleted += 1
            else:
                report.raced.append(key)

    if put or delete:
        await _each_endpoint(endpoints, write)
    if report.raced:
        log.info(
            "etcd sync left %d record(s) changed while it ran to the next sync: %s", len(report.raced), report.raced
        )
    return report


async def _if_unchanged(client: aetcd.Client, key: str, revision: int, operation: object) -> bool:
    """Apply ``operation`` if ``key`` was last changed at ``revision``; whether it was applied."""
    succeeded, _ = await client.transaction(
        compare=[client.transactions.mod(key.encode()) == revision], success=[operation], failure=[]
    )
    return bool(succeeded)


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
