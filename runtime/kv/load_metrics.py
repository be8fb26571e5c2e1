"""What an instance publishes about its load, every second, on ``<ns>.<comp>.load_metrics``.

One ``WorkerLoad`` (runtime/kv/events.py) per dp rank, as JSON: an engine that reports its KV cache
(a ``KvEventSource``) gives its ranks' running and waiting requests, KV usage and prefix hit rate;
any other engine is one rank with its active request count.
"""

import asyncio
import contextlib
from collections.abc import Callable

import msgspec
import nats.errors
from nats.aio.client import Client as NATS

from runtime.kv.events import KvEventSource, WorkerLoad

LOAD_METRICS_INTERVAL = 1.0

#: The reports of one moment, one per dp rank.
LoadReports = Callable[[], list[WorkerLoad]]


def active_requests_load(instance_id: int, active_requests: Callable[[], int]) -> LoadReports:
    """Reports for an engine that says nothing of its cache: one rank, its active requests."""
    return lambda: [WorkerLoad(instance_id=instance_id, active_requests=active_requests())]


def engine_load(instance_id: int, source: KvEventSource) -> LoadReports:
    """Reports from ``source.load()``, stamped with ``instance_id``."""
    replace = msgspec.structs.replace
    return lambda: [replace(report, instance_id=instance_id) for report in source.load()]


def waiting_requests(source: KvEventSource) -> Callable[[], int]:
    """The requests waiting in ``source``'s queues, every rank together (a rank that does not say counts
    all it holds)."""

    def waiting() -> int:
        return sum(report.active_requests if report.waiting is None else report.waiting for report in source.load())

    return waiting


async def publish_load_forever(
    nc: NATS, subject: str, reports: LoadReports, interval: float = LOAD_METRICS_INTERVAL
) -> None:
    """Publish ``reports()`` on ``subject`` every ``interval`` seconds until cancelled."""
    encode = msgspec.json.encode
    while True:
        await asyncio.sleep(interval)
        for report in reports():
            # A NATS outage is reported by the connection itself; the next tick tries again.
            with contextlib.suppress(nats.errors.Error):
                await nc.publish(subject, encode(report))
