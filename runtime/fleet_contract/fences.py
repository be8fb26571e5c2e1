"""Fences: how the control plane retires worker instances whose node it has given up on.

When a node stops heartbeating, the control plane fails its instances and places them elsewhere. Its
workers may still run (the agent died, not the node), still registered in etcd and still served by
gateways beside their replacements. So the control plane puts a fence for each of those instances,
``flotilla/fences/<instance id in hex>`` with the reason as value, and every worker watches its own
fence: when it appears, the worker logs the reason, deregisters and exits.

A fence lives under a lease of its own that nobody refreshes, so it vanishes after ``FENCE_TTL_S``;
instance ids are random 63-bit numbers, never reused, so a fence can only ever stop the one worker.
"""

import contextlib
import logging
from collections.abc import Callable, Iterable

import aetcd

from runtime.cluster.discovery import INSTANCES_PREFIX, Discovery
from runtime.errors import DiscoveryUnavailable
from runtime.settings import parse_etcd_endpoint

log = logging.getLogger(__name__)

FENCES_PREFIX = "flotilla/fences/"
FENCE_TTL_S = 3600  # far longer than any worker keeps running without reaching etcd
_RPC_TIMEOUT_S = 5.0


def fence_key(instance_id: int) -> str:
    """The etcd key that, once put, stops the worker with ``instance_id``."""
    return f"{FENCES_PREFIX}{instance_id:x}"


async def put_fences(endpoints: list[str], instance_ids: Iterable[int], reason: str) -> None:
    """Fence ``instance_ids`` with ``reason``, through the first of ``endpoints`` that answers.

    Raises ConfigError for a malformed endpoint, DiscoveryUnavailable when no endpoint answers.
    """
    ids = sorted(set(instance_ids))
    if not ids:
        return
    failures = []
    for host, port in (parse_etcd_endpoint(endpoint) for endpoint in endpoints):
        client = aetcd.Client(host=host, port=port, timeout=_RPC_TIMEOUT_S)
        try:
            lease = await client.lease(FENCE_TTL_S)
            for instance_id in ids:
                await client.put(fence_key(instance_id).encode(), reason.encode(), lease=lease.id)
        except aetcd.ClientError as exc:
            failures.append(f"{host}:{port}: {str(exc).rpartition(': ')[2] or exc}")
            continue
        finally:
            await client.close()
        log.info("fenced %d worker instance(s) in etcd at %s:%d: %s", len(ids), host, port, reason)
        return
    raise DiscoveryUnavailable(f"cannot reach etcd to fence workers ({'; '.join(failures)})")


async def live_instance_ids(endpoints: list[str]) -> set[int]:
    """The ids of the worker instances registered in etcd now, read through the first endpoint that answers.

    A registration lives under its worker's lease, so an id listed here belongs to a process that renewed
    its lease within the lease's TTL: alive, whatever its agent's silence says. Raises ConfigError for a
    malformed endpoint, DiscoveryUnavailable when no endpoint answers.
    """
    failures = []
    for host, port in (parse_etcd_endpoint(endpoint) for endpoint in endpoints):
        client = aetcd.Client(host=host, port=port, timeout=_RPC_TIMEOUT_S)
        try:
            response = await client.get_prefix(INSTANCES_PREFIX.encode(), keys_only=True)
        except aetcd.ClientError as exc:
            failures.append(f"{host}:{port}: {str(exc).rpartition(': ')[2] or exc}")
            continue
        finally:
            await client.close()
        ids = set()
        for kv in response.kvs:
            # flotilla/instances/<namespace>/<component>/<endpoint>/<id in hex>
            with contextlib.suppress(ValueError):
                ids.add(int(bytes(kv.key).decode(errors="replace").rpartition("/")[2], 16))
        return ids
    raise DiscoveryUnavailable(f"cannot reach etcd to see which workers are alive ({'; '.join(failures)})")


async def watch_own_fence(discovery: Discovery, instance_id: int, on_fenced: Callable[[str], None]) -> None:
    """Call ``on_fenced(reason)`` once the fence of ``instance_id`` is put, then return.

    Rides out etcd outages as ``Discovery.watch_prefix`` does (a fence put meanwhile is seen in the
    listing that follows).
    """
    key = fence_key(instance_id)
    async for event in discovery.watch_prefix(key):
        # The prefix of "…/abc" also matches "…/abcd": only this instance's own key counts.
        if event.kind == "put" and event.key == key:
            on_fenced((event.value or b"").decode(errors="replace") or "no reason given")
            return
