"""Run the control plane's HTTP requests on a few reused threads, people's requests before agents'.

Django's ASGI handler runs each request's synchronous code in a ``ThreadSensitiveContext`` of its own:
a new thread per request, hence a new database connection per request, and no bound on how many run at
once. Under 200 agents heartbeating, requests waiting on SQLite's write lock became ~140 threads
fighting for the GIL while the lock holder waited for it (docs/benchmarks.md). Entering a context with
our own single-thread executor first makes Django's inner context a no-op: the request runs on one of
``threads`` long-lived threads, each keeping its database connection (``CONN_MAX_AGE=None``), and the
requests beyond them wait in the event loop, costing nothing.

Waiting requests get a thread in order of priority, then arrival: an agent's report (``/api/v1/agent/``)
waits behind every request of a person, so a burst of heartbeats delays the next heartbeats by a few
milliseconds, not an operator's page. Agents report every few seconds and tolerate that.
"""

import asyncio
import heapq
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import ThreadSensitiveContext

from controlplane.body_limit import ASGIApp, Receive, Scope, Send

PERSON, AGENT = 0, 1  # priorities: lower runs first
AGENT_PATH_PREFIX = "/api/v1/agent/"


def agents_last(scope: Scope) -> int:
    """The priority of an HTTP request: agents' reports after everything else."""
    return AGENT if scope.get("path", "").startswith(AGENT_PATH_PREFIX) else PERSON


class ThreadPool:
    """``threads`` single-thread executors, lent one per request, waiters served by (priority, arrival)."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, not {threads}")
        self._idle = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"request-{n}") for n in range(threads)]
        self._waiting: list[tuple[int, int, asyncio.Future[ThreadPoolExecutor]]] = []
        self._arrivals = itertools.count()

    async def acquire(self, priority: int) -> ThreadPoolExecutor:
        if self._idle and not self._waiting:
            return self._idle.pop()
        lent: asyncio.Future[ThreadPoolExecutor] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (priority, next(self._arrivals), lent))
        try:
            return await lent
        except asyncio.CancelledError:
            # Lent just as the request was cancelled: pass the thread on rather than lose it.
            if lent.done() and not lent.cancelled():
                self.release(lent.result())
            raise

    def release(self, executor: ThreadPoolExecutor) -> None:
        while self._waiting:
            _, _, waiter = heapq.heappop(self._waiting)
            if not waiter.done():  # skip requests cancelled while they waited
                waiter.set_result(executor)
                return
        self._idle.append(executor)


def on_request_threads(app: ASGIApp, threads: int, priority: Callable[[Scope], int] = agents_last) -> ASGIApp:
    """Wrap ``app`` so each HTTP request's synchronous Django code runs on one of ``threads`` reused threads.

    Requests waiting for a thread get one in order of ``priority(scope)`` (lower first), then arrival.
    Other scopes (websockets, lifespan) pass through unchanged. Raises ValueError when ``threads`` < 1.
    """
    if threads < 1:
        raise ValueError(f"threads must be at least 1, not {threads}")
    pool: ThreadPool | None = None  # made on first use, in the server's event loop

    async def pooled(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal pool
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        if pool is None:
            pool = ThreadPool(threads)
        executor = await pool.acquire(priority(scope))
        try:
            async with ThreadSensitiveContext(executor=executor):
                await app(scope, receive, send)
        finally:
            pool.release(executor)

    return pooled
