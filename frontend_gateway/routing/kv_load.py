"""The load the KV router has put on each worker, corrected by what the workers report.

The router counts its own decisions: a request's prompt tokens still to compute are *in flight* from
the decision until its first output (``prefill_done``), and its KV blocks are *active* until it
finishes. Active blocks are counted as a worker holds them: a full prompt block (named by its chained
hash) that several running requests share is held once, as vLLM's prefix cache and Dynamo's router
(``--router-assume-kv-reuse``) count it; a request's last partial block and the blocks its answer will
fill are its own. The answer's blocks are estimated from ``max_tokens`` (capped: a client that leaves
it at the context's limit rarely writes that much), so identical prompts still spread: each running
request grows its own blocks on its worker, and the router sees that before it happens.

That count is exact and immediate but sees only the decisions this router hears of: its own, and with
``--router-replica-sync`` those of the pool's routers in other ingress processes (replica_sync.py keeps
them under each replica's id, and ends them with that replica's notices or its silence). The workers'
own reports (``WorkerLoad.kv_active_blocks``, once a second) see every router's traffic, but late, and
without the requests still on their way to the worker. So when a fresh report exists, a worker's active blocks are
the reported number plus what this router's decisions changed since it arrived, and never fewer than
this router's own count: a report sent before a burst reached the worker must not make it look idle
and draw the next burst as well.
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from frontend_gateway.routing.kv_indexer import Worker
from runtime.kv.events import WorkerLoad

#: A report older than this no longer corrects the router's own count (workers report every second).
REPORT_FRESH_S = 5.0


@dataclass(slots=True)
class _Request:
    worker: Worker
    prefill_tokens: int
    hashes: Sequence[int]  # its full prompt blocks, which running requests may share
    own_blocks: int  # its partial last block and its answer's blocks, shared with nobody
    prefilling: bool = True


@dataclass(slots=True)
class _Worker:
    prefill_tokens: int = 0
    held: dict[int, int] = field(default_factory=dict)  # shareable blocks -> running requests holding them
    own_blocks: int = 0
    requests: int = 0
    reported_blocks: int | None = None
    blocks_at_report: int = 0  # this router's own count when the report arrived
    reported_at: float | None = None
    reported_usage: float | None = None
    reported_waiting: int | None = None
    total_blocks: int | None = None  # the cache's size, as last reported

    @property
    def blocks(self) -> int:
        """Active blocks by this router's count: each shared block once, plus the requests' own."""
        return len(self.held) + self.own_blocks


class ActiveLoad:
    """Per worker: prompt tokens in flight and active KV blocks, from decisions and reports."""

    def __init__(self, *, report_fresh_s: float = REPORT_FRESH_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._report_fresh_s = report_fresh_s
        self._clock = clock
        self._requests: dict[str, _Request] = {}
        self._workers: dict[Worker, _Worker] = {}

    def started(
        self, request_id: str, worker: Worker, *, prefill_tokens: int, hashes: Sequence[int] = (), own_blocks: int = 0
    ) -> None:
        """A request was routed to ``worker``, with ``prefill_tokens`` to compute; it will hold the full
        prompt blocks ``hashes`` (shared with the worker's other requests that hold them) and
        ``own_blocks`` more of its own."""
        if request_id in self._requests:
            self.finished(request_id)  # the previous attempt's notice was lost: never count it twice
        self._requests[request_id] = _Request(worker, prefill_tokens, hashes, own_blocks)
        load = self._workers.get(worker)
        if load is None:
            load = self._workers[worker] = _Worker()
        load.prefill_tokens += prefill_tokens
        held = load.held
        for block in hashes:
            held[block] = held.get(block, 0) + 1
        load.own_blocks += own_blocks
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
        held = load.held
        for block in request.hashes:  # a plain dict: Counter's Python-level __delitem__ costs 5x here
            count = held[block]
            if count == 1:
                del held[block]
            else:
                held[block] = count - 1
        load.own_blocks -= request.own_blocks
        load.requests -= 1

    def observe(self, report: WorkerLoad) -> None:
        """A worker's own report of its load: ``kv_active_blocks`` corrects the count; its usage and
        waiting requests are kept for the busy thresholds."""
        worker = (report.instance_id, report.dp_rank)
        load = self._workers.get(worker)
        if load is None:
            load = self._workers[worker] = _Worker()
        load.reported_at = self._clock()
        load.reported_usage = report.kv_usage
        load.reported_waiting = report.waiting
        if report.kv_total_blocks:
            load.total_blocks = report.kv_total_blocks
        if report.kv_active_blocks is not None:
            load.reported_blocks = max(0, report.kv_active_blocks)
            load.blocks_at_report = load.blocks

    def new_blocks(self, worker: Worker, hashes: Sequence[int]) -> int:
        """How many of the full prompt blocks ``hashes`` no running request on ``worker`` holds yet."""
        load = self._workers.get(worker)
        if load is None or not load.held:
            return len(hashes)
        return len(hashes) - sum(map(load.held.__contains__, hashes))  # the loop in C: this runs per worker

    def prefill_tokens(self, worker: Worker) -> int:
        load = self._workers.get(worker)
        return 0 if load is None else load.prefill_tokens

    def decode_blocks(self, worker: Worker) -> int:
        """Active blocks: the fresh report plus this router's changes since, never fewer than this
        router's own count; this router's count alone when no report is fresh."""
        load = self._workers.get(worker)
        if load is None:
            return 0
        if load.reported_blocks is None or not self._fresh(load):
            return load.blocks
        return max(load.blocks, load.reported_blocks + load.blocks - load.blocks_at_report)

    def busy(self, worker: Worker, *, kv_usage: float | None, waiting: int | None) -> bool:
        """Whether ``worker``'s KV cache is at least ``kv_usage`` full, or at least ``waiting`` requests wait
        there (None: that threshold is off).

        Its usage is the larger of its fresh report and this router's count of the blocks it holds (new
        decisions count at once, reports a second late); its waiting requests are its fresh report's. A
        worker never heard from is not busy.
        """
        load = self._workers.get(worker)
        if load is None:
            return False
        fresh = self._fresh(load)
        if kv_usage is not None:
            usage = load.reported_usage if fresh and load.reported_usage is not None else 0.0
            if load.total_blocks:
                usage = max(usage, self.decode_blocks(worker) / load.total_blocks)
            if usage >= kv_usage:
                return True
        return waiting is not None and fresh and load.reported_waiting is not None and load.reported_waiting >= waiting

    def kv_usage(self, worker: Worker) -> float | None:
        """How full ``worker``'s KV cache is (0..1), as ``busy`` reckons it; None when it was never heard from."""
        load = self._workers.get(worker)
        if load is None:
            return None
        usage = load.reported_usage if self._fresh(load) else None
        if load.total_blocks:
            usage = max(usage or 0.0, self.decode_blocks(worker) / load.total_blocks)
        return usage

    def _fresh(self, load: _Worker) -> bool:
        return load.reported_at is not None and self._clock() - load.reported_at <= self._report_fresh_s

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
