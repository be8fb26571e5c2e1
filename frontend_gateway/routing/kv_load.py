"""The load the KV router has put on each worker, corrected by what the workers report.

The router counts its own decisions: a request's prompt tokens still to compute are *in flight* from
the decision until its first output (``prefill_done``), and its KV blocks are *active* until it
finishes. That count is exact and immediate but sees only this router's traffic; the workers' own
reports (``WorkerLoad.kv_active_blocks``, once a second) see every router's traffic and the blocks
that requests share, but late, and without the requests still on their way to the worker. So when a
fresh report exists, a worker's active blocks are the reported number plus what this router's
decisions changed since it arrived, and never fewer than this router's own count: a report sent
before a burst reached the worker must not make it look idle and draw the next burst as well.

This router counts every request's whole prompt, shared prefix included: a shared block is held once
in memory, but each request running on a worker still costs it a decode slot and attention over its
whole context, so identical requests must still spread.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

from frontend_gateway.routing.kv_indexer import Worker
from runtime.kv_events import WorkerLoad

#: A report older than this no longer corrects the router's own count (workers report every second).
REPORT_FRESH_S = 5.0


@dataclass(slots=True)
class _Request:
    worker: Worker
    prefill_tokens: int
    blocks: int
    prefilling: bool = True


@dataclass(slots=True)
class _Worker:
    prefill_tokens: int = 0
    blocks: int = 0
    requests: int = 0
    reported_blocks: int | None = None
    blocks_at_report: int = 0  # this router's own count when the report arrived
    reported_at: float = 0.0


class ActiveLoad:
    """Per worker: prompt tokens in flight and active KV blocks, from decisions and reports."""

    def __init__(self, *, report_fresh_s: float = REPORT_FRESH_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._report_fresh_s = report_fresh_s
        self._clock = clock
        self._requests: dict[str, _Request] = {}
        self._workers: dict[Worker, _Worker] = {}

    def started(self, request_id: str, worker: Worker, *, prefill_tokens: int, blocks: int) -> None:
        """A request was routed to ``worker``, with ``prefill_tokens`` to compute and ``blocks`` to hold."""
        if request_id in self._requests:
            self.finished(request_id)  # the previous attempt's notice was lost: never count it twice
        self._requests[request_id] = _Request(worker, prefill_tokens, blocks)
        load = self._workers.get(worker)
        if load is None:
            load = self._workers[worker] = _Worker()
        load.prefill_tokens += prefill_tokens
        load.blocks += blocks
        load.requests += 1

    def prefill_done(self, request_id: str) -> None:
        """The request's prompt is computed (its first output arrived)."""
        request = self._requests.get(request_id)
        if request is None or not request.prefilling:
            return
        request.prefilling = False
        if (load := self._workers.get(request.worker)) is not None:
            load.prefill_tokens -= request.prefill_tokens

    def finished(self, request_id: str) -> None:
        """The request is over: its tokens and blocks no longer load its worker."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        load = self._workers.get(request.worker)
        if load is None:
            return
        if request.prefilling:
            load.prefill_tokens -= request.prefill_tokens
        load.blocks -= request.blocks
        load.requests -= 1

    def observe(self, report: WorkerLoad) -> None:
        """A worker's own report of its load; only ``kv_active_blocks`` corrects the count."""
        if report.kv_active_blocks is None:
            return
        worker = (report.instance_id, report.dp_rank)
        load = self._workers.get(worker)
        if load is None:
            load = self._workers[worker] = _Worker()
        load.reported_blocks = max(0, report.kv_active_blocks)
        load.blocks_at_report = load.blocks
        load.reported_at = self._clock()

    def prefill_tokens(self, worker: Worker) -> int:
        load = self._workers.get(worker)
        return 0 if load is None else load.prefill_tokens

    def decode_blocks(self, worker: Worker) -> int:
        """Active blocks: the fresh report plus this router's changes since, never fewer than this
        router's own count; this router's count alone when no report is fresh."""
        load = self._workers.get(worker)
        if load is None:
            return 0
        if load.reported_blocks is None or self._clock() - load.reported_at > self._report_fresh_s:
            return load.blocks
        return max(load.blocks, load.reported_blocks + load.blocks - load.blocks_at_report)

    def requests(self, worker: Worker) -> int:
        """This router's requests active on ``worker``."""
        load = self._workers.get(worker)
        return 0 if load is None else load.requests

    def in_flight(self) -> int:
        """Requests routed and not yet finished, on every worker."""
        return len(self._requests)

    def remove_instance(self, instance_id: int) -> None:
        """Forget the load of every dp rank of ``instance_id`` (its requests' notices become no-ops)."""
        for worker in [worker for worker in self._workers if worker[0] == instance_id]:
            del self._workers[worker]
        for request_id in [rid for rid, request in self._requests.items() if request.worker[0] == instance_id]:
            del self._requests[request_id]
