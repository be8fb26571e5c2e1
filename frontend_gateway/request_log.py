"""The gateway's side of the request log: one record per finished request, published on NATS in batches.

The HTTP app (``http_app.py``) hands each finished request's ``RequestRecord`` (runtime/fleet_contract/
request_records.py) to ``RecordPublisher.add``, which only appends it to a bounded buffer: a request never
waits for NATS. A task flushes the buffer every ``interval`` (0.5 s) as ``RecordBatch`` messages. Where NATS is
not connected, or a publish fails, or the buffer is full, the records are dropped and counted
(``flotilla_frontend_request_records_dropped_total``, by reason): the request log is display data, and the
gateway must neither slow nor fail for it.

``TimedMetrics`` collects a request's TTFT and mean ITL where the app already observes them for its
Prometheus histograms, so that the record carries the same figures.
"""

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from nats.aio.client import Client as NATS

from runtime.fleet_contract.request_records import (
    MAX_BATCH_RECORDS,
    MAX_NAME,
    MAX_SECONDS,
    MAX_SHORT,
    REQUEST_RECORDS_SUBJECT,
    RecordBatch,
    RequestRecord,
    encode_batch,
)
from runtime.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.5
#: The routes whose requests are recorded, and the ``endpoint`` their records name.
LOGGED_ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/embeddings": "embeddings",
}
#: The status a record gives a request whose client left before its answer (nginx's "client closed request").
CLIENT_CLOSED = 499
#: Records kept while NATS is slow: ten seconds of a busy gateway. Beyond it new ones are dropped.
DEFAULT_MAX_BUFFERED = 20_000


class DropCounter(Protocol):
    def __call__(self, reason: str, count: int) -> None: ...


class RecordPublisher:
    """Buffers records and publishes them on ``nc`` every ``interval`` seconds; ``start`` begins, ``close`` ends
    (publishing what is left when NATS is there)."""

    def __init__(
        self,
        nc: NATS,
        *,
        interval: float = DEFAULT_INTERVAL_S,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
        on_dropped: DropCounter | None = None,
        subject: str = REQUEST_RECORDS_SUBJECT,
    ) -> None:
        self._nc = nc
        self.interval = interval
        self._max_buffered = max_buffered
        self._on_dropped = on_dropped
        self._subject = subject
        self._gateway = f"{socket.gethostname()}:{os.getpid()}"
        self._buffer: list[RequestRecord] = []
        self._task: asyncio.Task[None] | None = None
        self._failures = RateLimitedLog(log, period_s=30.0)
        #: Counters, for tests and logs.
        self.published = 0
        self.dropped = 0

    def add(self, record: RequestRecord) -> None:
        """Keep ``record`` for the next batch (dropped and counted when the buffer is full). Never blocks."""
        if len(self._buffer) >= self._max_buffered:
            self._drop("buffer_full", 1)
            return
        self._buffer.append(record)
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="request log")

    async def close(self) -> None:
        """Stop the flushing task and publish what is buffered (dropped when NATS is not there)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.flush()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.flush()

    async def flush(self) -> None:
        """Publish the buffered records now, in batches of at most MAX_BATCH_RECORDS."""
        records, self._buffer = self._buffer, []
        if not records:
            return
        if not self._nc.is_connected:
            self._drop("nats_unavailable", len(records))
            return
        for start in range(0, len(records), MAX_BATCH_RECORDS):
            chunk = records[start : start + MAX_BATCH_RECORDS]
            try:
                await self._nc.publish(self._subject, encode_batch(RecordBatch(gateway=self._gateway, records=chunk)))
            except Exception as exc:  # nats' errors, OSError: the log is not worth a failed gateway
                self._drop("publish_failed", len(chunk))
                self._failures.warning(f"request log: cannot publish records on NATS ({exc}); they are dropped")
                continue
            self.published += len(chunk)

    def _drop(self, reason: str, count: int) -> None:
        self.dropped += count
        if self._on_dropped is not None:
            self._on_dropped(reason, count)


class Timed(Protocol):
    """What keeps a request's timings: its Generation (frontend_gateway/models/pipeline.py)."""

    ttft_s: float | None
    itl_s: float | None


class _Observer:
    """A Prometheus child whose observations are also kept on a Timing."""

    __slots__ = ("_child", "_keep")

    def __init__(self, child: Any, keep: Callable[[float], None]) -> None:
        self._child = child
        self._keep = keep

    def observe(self, value: float) -> None:
        self._child.observe(value)
        self._keep(value)


class TimedMetrics:
    """A model's metrics (``ModelMetrics``) whose ``ttft`` and ``inter_token_latency`` observations are kept on
    ``timing`` too (the first TTFT: a batch observes one per prompt); everything else is the model's own."""

    def __init__(self, metrics: Any, timing: Timed) -> None:
        self._metrics = metrics
        self.ttft = _Observer(metrics.ttft, lambda value: _first_ttft(timing, value))
        self.inter_token_latency = _Observer(metrics.inter_token_latency, lambda value: setattr(timing, "itl_s", value))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._metrics, name)


def _first_ttft(timing: Timed, value: float) -> None:
    if timing.ttft_s is None:
        timing.ttft_s = value


def request_record(
    arrived: float,
    endpoint: str,
    status: int,
    error: str,
    *,
    model: str,
    api_key_id: int | None,
    generation: Any,
    embedded_tokens: int | None,
    duration: float,
) -> RequestRecord:
    """The record of a finished request: its ``generation`` (a Generation, None when it was refused before one
    began) gives its id, tokens, timings and the router's decision; client-supplied text is cut to the
    contract's bounds, so that a record is never refused for a long model name."""
    if generation is None:
        return RequestRecord(
            at=arrived,
            request_id=_new_id(),
            model=model[:MAX_NAME],
            endpoint=endpoint,
            status=status,
            error=error[:MAX_SHORT],
            api_key_id=api_key_id,
            prompt_tokens=embedded_tokens or 0,
            duration_s=_bounded(duration),
        )
    return RequestRecord(
        at=arrived,
        request_id=generation.request_id[:MAX_NAME],
        model=model[:MAX_NAME],
        endpoint=endpoint,
        status=status,
        error=error[:MAX_SHORT],
        api_key_id=api_key_id,
        route=generation.context.route,
        prompt_tokens=generation.prompt_tokens,
        cached_tokens=generation.cached_tokens,
        completion_tokens=generation.completion_tokens,
        ttft_s=None if generation.ttft_s is None else _bounded(generation.ttft_s),
        itl_s=None if generation.itl_s is None else _bounded(generation.itl_s),
        duration_s=_bounded(duration),
    )


def _bounded(seconds: float) -> float:
    return min(max(seconds, 0.0), MAX_SECONDS)


def _new_id() -> str:
    return uuid.uuid4().hex
