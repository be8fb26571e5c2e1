"""Admission control: how many requests generate at once in one gateway process, and who waits.

Overload must degrade, not collapse: past ``max_inflight`` requests wait, first come first served,
in a queue of at most ``max_queued``, each for at most ``queue_timeout_s``. What the queue cannot
hold is refused at once (429), and what waited too long is refused then (503), both with
``Retry-After`` so that clients back off instead of piling on. Requests already admitted are never
disturbed: they finish, only slower.

The queue is a deque of futures on the event loop: a slot freed by ``release`` is handed straight
to the oldest waiter, so a burst of new arrivals cannot overtake those already waiting.
"""

import asyncio
from collections import deque
from dataclasses import dataclass

from frontend_gateway.errors import Overloaded, QueueTimeout
from frontend_gateway.metrics import GatewayMetrics

# Chosen by measurement (bench/overload.py, docs/benchmarks.md): 10,000 streams opened at once through
# one ingress completed at 134 streams/s with 4,096 admitted at a time against 120/s with all admitted,
# and a 2-minute wait lets all of them finish instead of refusing those queued beyond 30 s.
DEFAULT_MAX_INFLIGHT = 4096
DEFAULT_MAX_QUEUED = 16384
DEFAULT_QUEUE_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True)
class AdmissionLimits:
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    max_queued: int = DEFAULT_MAX_QUEUED
    queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S


class Admission:
    """Counts generation slots; ``acquire`` before generating and ``release`` (exactly once) after."""

    __slots__ = ("_inflight", "_limits", "_metrics", "_queued", "_waiters")

    def __init__(self, limits: AdmissionLimits, metrics: GatewayMetrics) -> None:
        self._limits = limits
        self._metrics = metrics
        self._inflight = 0
        self._queued = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def queued(self) -> int:
        return self._queued

    def try_acquire(self) -> bool:
        """Take a free slot if there is one and no one waits for it; never waits."""
        if self._inflight < self._limits.max_inflight and not self._queued:
            self._inflight += 1
            return True
        return False

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue if all are busy.

        Raises Overloaded when the queue is full, QueueTimeout when the wait exceeds the limit.
        """
        if self.try_acquire():
            return  # the fast path: no future, no await
        limits = self._limits
        if self._queued >= limits.max_queued:
            self._metrics.admission_rejected(reason="queue_full")
            raise Overloaded(
                f"the server is at capacity ({limits.max_inflight} requests generating, "
                f"{limits.max_queued} waiting); retry shortly"
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._queued += 1
        self._metrics.queued_requests.inc()
        try:
            async with asyncio.timeout(limits.queue_timeout_s):
                await waiter
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return  # a slot was handed over just as the wait ran out: keep it
            self._give_up(waiter)
            self._metrics.admission_rejected(reason="queue_timeout")
            raise QueueTimeout(
                f"the request waited {limits.queue_timeout_s:g} s for one of {limits.max_inflight} "
                "generation slots; the server is overloaded, retry later"
            ) from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed a slot that no one will use: pass it on
            else:
                self._give_up(waiter)
            raise

    def release(self) -> None:
        """Give a slot back: to the oldest waiter still waiting, else to the pool."""
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():  # the futures of waiters that gave up are skipped
                waiter.set_result(None)
                self._dequeued()
                return
        self._inflight -= 1

    def _give_up(self, waiter: "asyncio.Future[None]") -> None:
        # Left in the deque (removing it would cost a scan); release() skips it.
        waiter.cancel()
        self._dequeued()

    def _dequeued(self) -> None:
        # Counted out when handed a slot, not when it resumes: ``_queued`` is the number still
        # waiting, so a new arrival takes a free slot at once instead of queueing behind no one.
        self._queued -= 1
        self._metrics.queued_requests.dec()
