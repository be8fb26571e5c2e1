"""The request log and the metric samples, written by the live bridge's process (``manage.py live_bridge``).

``TrafficRecorder`` subscribes to the gateways' record batches (runtime/fleet_contract/request_records.py),
decodes them within the contract's bounds (a batch that breaks one is refused whole, logged at most every 30 s),
finds each record's pipeline and instance (from the worker's endpoint id, through the bridge's
``InstanceDirectory``; else the pipeline by served name) and bulk-inserts the rows every ``flush_s`` (1 s).
Every ``sample_s`` (``FLOTILLA_METRICS_SAMPLE_S``, 10 s) it writes the MetricSamples of the window
(controlplane/traffic/sampling.py): one fleet-wide, one per pipeline that served or reported load, one per node;
and past ``retention`` it deletes old rows (``FLOTILLA_REQUEST_LOG_RETENTION``, ``FLOTILLA_METRICS_RETENTION``:
seconds, 86400 by default).

A record is counted in the window it was received in, not by its arrival time: a gateway's batch is at most a
second late. The database lost meanwhile: the rows of that flush and that window's samples are dropped and
logged; the next ones go in.
"""

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from channels.db import database_sync_to_async
from django.db import DatabaseError
from django.db.models import Sum
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from controlplane.deployments.models import Pipeline
from controlplane.fleet.models import Node
from controlplane.live.bridge import InstanceDirectory, Watched
from controlplane.traffic.models import MetricSample, RequestRecord
from controlplane.traffic.sampling import Window, load_figures, request_figures
from runtime.config import env_float
from runtime.fleet_contract import request_records as contract
from runtime.rate_limited_log import RateLimitedLog
from runtime.supervision import Supervisor

log = logging.getLogger(__name__)

DEFAULT_FLUSH_S = 1.0
DEFAULT_SAMPLE_S = 10.0
#: The shortest sample window: samples are written after a flush, and flushes come every ``DEFAULT_FLUSH_S``.
MIN_SAMPLE_S = DEFAULT_FLUSH_S
DEFAULT_RETENTION_S = 86_400.0
PRUNE_EVERY_S = 60.0


@dataclass(frozen=True)
class Retention:
    """How long request rows and metric samples are kept, in seconds."""

    requests_s: float = DEFAULT_RETENTION_S
    samples_s: float = DEFAULT_RETENTION_S

    @classmethod
    def from_environment(cls) -> "Retention":
        """From FLOTILLA_REQUEST_LOG_RETENTION and FLOTILLA_METRICS_RETENTION (seconds, at least 60). Raises
        ConfigError for a bad value."""
        return cls(
            env_float("FLOTILLA_REQUEST_LOG_RETENTION", DEFAULT_RETENTION_S, minimum=60.0),
            env_float("FLOTILLA_METRICS_RETENTION", DEFAULT_RETENTION_S, minimum=60.0),
        )


def sample_window_s() -> float:
    """Seconds per metric sample: ``FLOTILLA_METRICS_SAMPLE_S`` (default 10, at least 1). Shorter windows make
    more rows and noisier percentiles; tests shorten it to see a sample within seconds. Raises ConfigError."""
    return env_float("FLOTILLA_METRICS_SAMPLE_S", DEFAULT_SAMPLE_S, minimum=MIN_SAMPLE_S)


def to_row(record: contract.RequestRecord, watched: Watched | None) -> RequestRecord:
    """The row of a record; its pipeline and instance as the directory knows the worker (None: unknown)."""
    route = record.route
    return RequestRecord(
        at=datetime.datetime.fromtimestamp(record.at, tz=datetime.UTC),
        request_id=record.request_id,
        model=record.model,
        endpoint=record.endpoint,
        status=record.status,
        error=record.error,
        api_key_id=record.api_key_id,
        pipeline_id=None if watched is None else watched.pipeline_id,
        instance_id=None if watched is None else watched.instance_id,
        router_mode="" if route is None else route.mode,
        endpoint_instance_id=None if route is None else route.instance_id,
        dp_rank=None if route is None else route.dp_rank,
        overlap_blocks=None if route is None else route.overlap_blocks,
        prompt_blocks=None if route is None else route.prompt_blocks,
        cost=None if route is None else route.cost,
        candidates=None if route is None else route.candidates,
        prompt_tokens=record.prompt_tokens,
        cached_tokens=record.cached_tokens,
        completion_tokens=record.completion_tokens,
        ttft_s=record.ttft_s,
        itl_s=record.itl_s,
        duration_s=record.duration_s,
    )


def store_rows(rows: list[RequestRecord]) -> None:
    """Insert ``rows``, those without a pipeline given the one serving their model's name. Runs the ORM: call it
    from a thread. Raises DatabaseError."""
    unplaced = {row.model for row in rows if row.pipeline_id is None and row.model}
    if unplaced:
        by_name = dict(Pipeline.objects.filter(name__in=unplaced).values_list("name", "pk"))
        for row in rows:
            if row.pipeline_id is None:
                row.pipeline_id = by_name.get(row.model)
    RequestRecord.objects.bulk_create(rows, batch_size=500)


def write_samples(
    at: datetime.datetime, seconds: float, rows: list[RequestRecord], loads: list[tuple[int, Mapping[str, Any]]]
) -> int:
    """Write the window's samples: fleet-wide, per pipeline (those with requests or loads), per node. Runs the ORM:
    call it from a thread. Returns how many were written. Raises DatabaseError."""
    samples = [
        MetricSample(
            at=at,
            window_s=seconds,
            scope=MetricSample.Scope.FLEET,
            **request_figures(Window(seconds, rows)),
            **load_figures(load for _, load in loads),
        )
    ]
    pipelines = {row.pipeline_id for row in rows if row.pipeline_id is not None} | {pk for pk, _ in loads}
    existing = set(Pipeline.objects.filter(pk__in=pipelines).values_list("pk", flat=True))
    for pipeline_id in sorted(existing):
        samples.append(
            MetricSample(
                at=at,
                window_s=seconds,
                scope=MetricSample.Scope.PIPELINE,
                pipeline_id=pipeline_id,
                **request_figures(Window(seconds, [row for row in rows if row.pipeline_id == pipeline_id])),
                **load_figures(load for pk, load in loads if pk == pipeline_id),
            )
        )
    nodes = Node.objects.filter(state=Node.State.ONLINE).annotate(
        gpu_total=Sum("gpus__memory_total_bytes"), gpu_used=Sum("gpus__memory_used_bytes")
    )
    for node in nodes:
        utilisation = [gpu.utilization_percent for gpu in node.gpus.all()]
        samples.append(
            MetricSample(
                at=at,
                window_s=seconds,
                scope=MetricSample.Scope.NODE,
                node=node,
                memory_total_bytes=node.memory_total_bytes,
                memory_used_bytes=max(0, node.memory_total_bytes - node.memory_available_bytes),
                gpu_memory_total_bytes=node.gpu_total,
                gpu_memory_used_bytes=node.gpu_used,
                gpu_utilization_percent=sum(utilisation) / len(utilisation) if utilisation else None,
                cpu_utilization_percent=node.cpu_utilization_percent,
            )
        )
    MetricSample.objects.bulk_create(samples)
    return len(samples)


def prune(now: datetime.datetime, retention: Retention) -> tuple[int, int]:
    """Delete request rows and samples older than ``retention``; returns how many of each. Runs the ORM: call it
    from a thread. Raises DatabaseError."""
    requests, _ = RequestRecord.objects.filter(at__lt=now - datetime.timedelta(seconds=retention.requests_s)).delete()
    samples, _ = MetricSample.objects.filter(at__lt=now - datetime.timedelta(seconds=retention.samples_s)).delete()
    return requests, samples


class TrafficRecorder:
    """Stores the gateways' records and writes the metric samples; ``loads`` gives each running instance's latest
    load as ``(pipeline id, load)`` pairs (the live bridge's ``latest_loads``)."""

    def __init__(
        self,
        nc: NATS,
        directory: InstanceDirectory,
        supervisor: Supervisor,
        *,
        loads: Callable[[], Iterable[tuple[int, Mapping[str, Any]]]] = list,
        flush_s: float = DEFAULT_FLUSH_S,
        sample_s: float = DEFAULT_SAMPLE_S,
        retention: Retention | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._nc = nc
        self._directory = directory
        self._supervisor = supervisor
        self._loads = loads
        self.flush_s = flush_s
        self.sample_s = sample_s
        self.retention = retention or Retention()
        self._clock = clock
        self._pending: list[RequestRecord] = []  # received, not yet stored
        self._window: list[RequestRecord] = []  # stored since the last sample
        self._sampled_at: float | None = None
        self._pruned_at: float | None = None
        self._store: Callable[[list[RequestRecord]], Awaitable[None]] = database_sync_to_async(store_rows)
        self._write: Callable[..., Awaitable[int]] = database_sync_to_async(write_samples)
        self._prune: Callable[..., Awaitable[tuple[int, int]]] = database_sync_to_async(prune)
        self._bad = RateLimitedLog(log, period_s=30.0)
        self._db_failures = RateLimitedLog(log, period_s=30.0)
        #: Set after every batch received (tests await it), and counters for tests and logs.
        self.received_event = asyncio.Event()
        self.received = 0
        self.refused_batches = 0
        self.stored = 0

    def start(self) -> None:
        """Own the subscription and the writing loop (restarted if they fail) from now on."""
        self._supervisor.own(self._consume, name="request records", restart=True)
        self._supervisor.own(self._write_loop, name="request log writer", restart=True)

    async def _consume(self) -> None:
        subscription = await self._nc.subscribe(contract.REQUEST_RECORDS_SUBJECT)
        try:
            async for message in subscription.messages:
                await self.take(message)
        finally:
            with contextlib.suppress(Exception):  # the connection may be closing already
                await subscription.unsubscribe()

    async def take(self, message: Msg) -> None:
        """Keep the records of one batch for the next flush (a batch out of bounds is refused whole, logged)."""
        try:
            batch = contract.decode_batch(message.data)
        except msgspec.DecodeError as exc:
            self.refused_batches += 1
            self._bad.warning(
                f"request log: a batch on {message.subject} is not what gateways publish ({exc}); ignored"
            )
            return
        for record in batch.records:
            watched = None if record.route is None else await self._directory.find(record.route.instance_id)
            self._pending.append(to_row(record, watched))
        self.received += len(batch.records)
        self.received_event.set()

    async def _write_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            await self.flush()
            now = self._clock()
            if self._sampled_at is None:
                self._sampled_at = now
            elif now - self._sampled_at >= self.sample_s:
                await self.sample()
            if self._pruned_at is None or now - self._pruned_at >= PRUNE_EVERY_S:
                await self.prune()

    async def flush(self) -> None:
        """Store the records received since the last flush."""
        rows, self._pending = self._pending, []
        if not rows:
            return
        try:
            await self._store(rows)
        except DatabaseError as exc:
            self._db_failures.warning(f"request log: cannot store {len(rows)} records ({exc}); they are dropped")
            return
        self.stored += len(rows)
        self._window.extend(rows)

    async def sample(self) -> int:
        """Write the samples of the window since the last one (its records stored so far); returns how many."""
        now = self._clock()
        seconds = self.sample_s if self._sampled_at is None else max(now - self._sampled_at, 0.001)
        rows, self._window = self._window, []
        self._sampled_at = now
        at = datetime.datetime.fromtimestamp(now, tz=datetime.UTC)
        try:
            return await self._write(at, seconds, rows, list(self._loads()))
        except DatabaseError as exc:
            self._db_failures.warning(f"request log: cannot write the metric samples ({exc}); this window is lost")
            return 0

    async def prune(self) -> None:
        """Delete what is past its retention."""
        self._pruned_at = self._clock()
        try:
            requests, samples = await self._prune(
                datetime.datetime.fromtimestamp(self._pruned_at, tz=datetime.UTC), self.retention
            )
        except DatabaseError as exc:
            self._db_failures.warning(f"request log: cannot prune old rows ({exc}); trying again later")
            return
        if requests or samples:
            log.info("request log: pruned %d request records and %d metric samples", requests, samples)
