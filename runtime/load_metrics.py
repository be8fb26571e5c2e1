"""What an instance publishes about its load, every second, on ``<ns>.<comp>.load_metrics``."""

import asyncio
import contextlib
from collections.abc import Callable

import msgspec
import nats.errors
from nats.aio.client import Client as NATS

LOAD_METRICS_INTERVAL = 1.0


class LoadMetrics(msgspec.Struct, kw_only=True):
    """One instance's load at one moment."""

    instance_id: int
    active_requests: int
    kv_usage: float | None = None


async def publish_load_forever(
    nc: NATS,
    subject: str,
    instance_id: int,
    active_requests: Callable[[], int],
    interval: float = LOAD_METRICS_INTERVAL,
) -> None:
    """Publish ``LoadMetrics`` on ``subject`` every ``interval`` seconds until cancelled."""
    while True:
        await asyncio.sleep(interval)
        metrics = LoadMetrics(instance_id=instance_id, active_requests=active_requests())
        # A NATS outage is reported by the connection itself; the next tick tries again.
        with contextlib.suppress(nats.errors.Error):
            await nc.publish(subject, msgspec.json.encode(metrics))
