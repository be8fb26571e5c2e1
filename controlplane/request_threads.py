"""Run the control plane's HTTP requests on a few reused threads, in three lanes that cannot starve
each other: people, agents, and log tails.

Django's ASGI handler runs each request's synchronous code in a ``ThreadSensitiveContext`` of its own:
a new thread per request, hence a new database connection per request, and no bound on how many run at
once. Under 200 agents heartbeating, requests waiting on SQLite's write lock became ~140 threads
fighting for the GIL while the lock holder waited for it (docs/benchmarks.md). Entering a context with
our own single-thread executor first makes Django's inner context a no-op: the request runs on one of a
few long-lived threads, each keeping its database connection (``CONN_MAX_AGE=None``), and the requests
beyond them wait in the event loop, costing nothing. A request takes its thread only once its body is
read whole (controlplane/body_limit.py wraps this), so a slow client holds no thread.

Why lanes, each with threads of its own, rather than one pool with priorities: with one pool, whichever
kind of request came second waited for every thread the first kind held. People first meant that a
person's slow requests (a large page, a log tail waiting 5 s on an agent) held every thread while the
heartbeats waited, and a node whose heartbeats wait long enough is taken for dead. Agents first would
let a fleet's burst of heartbeats stall every page. Separate lanes bound each kind by its own threads:

* **agents** (``/api/v1/agent/``: heartbeats, registrations, instance and download reports) run on
  ``agent_threads`` threads no person's request can take;
* **log tails** (``/api/v1/instances/{id}/log/`` and the dashboard's ``/instances/{id}/log/``) wait up
  to ``FLOTILLA_LOG_TAIL_TIMEOUT_S`` on a node's agent, so they run on ``log_tail_threads`` threads of
  their own, and beyond those they do not queue: the answer is a 503 with ``Retry-After`` at once;
* **people** (everything else) run on ``threads`` threads, in order of arrival.
"""

import asyncio
import collections
import math
import re
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import ThreadSensitiveContext

from controlplane.body_limit import ASGIApp, Receive, Scope, Send, send_refusal

PEOPLE, AGENTS, LOG_TAILS = "people", "agents", "log tails"
AGENT_PATH_PREFIX = "/api/v1/agent/"
_LOG_TAIL_PATH = re.compile(r"^(?:/api/v1)?/instances/[^/]+/log/?$")


def lane_of(scope: Scope) -> str:
    """Which lane an HTTP request runs in: AGENTS, LOG_TAILS or PEOPLE, by its path."""
    path = scope.get("path", "")
    if path.startswith(AGENT_PATH_PREFIX):
        return AGENTS
    if _LOG_TAIL_PATH.match(path):
        return LOG_TAILS
    return PEOPLE


class ThreadPool:
    """``threads`` single-thread executors, lent one per request; waiters are served in order of arrival."""

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, not {threads}")
        self._idle = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-{n}") for n in range(threads)]
        self._waiting: collections.deque[asyncio.Future[ThreadPoolExecutor]] = collections.deque()

    def try_acquire(self) -> ThreadPoolExecutor | None:
        """An idle thread, or None when every thread is lent."""
        return self._idle.pop() if self._idle and not self._waiting else None

    async def acquire(self) -> ThreadPoolExecutor:
        """A thread, once one is free."""
        if (idle := self.try_acquire()) is not None:
            return idle
        lent: asyncio.Future[ThreadPoolExecutor] = asyncio.get_running_loop().create_future()
        self._waiting.append(lent)
        try:
            return await lent
        except asyncio.CancelledError:
            # Lent just as the request was cancelled: pass the thread on rather than lose it.
            if lent.done() and not lent.cancelled():
                self.release(lent.result())
            raise

    def release(self, executor: ThreadPoolExecutor) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():  # skip requests cancelled while they waited
                waiter.set_result(executor)
                return
        self._idle.append(executor)


def on_request_threads(
    app: ASGIApp,
    threads: int,
    *,
    agent_threads: int = 2,
    log_tail_threads: int = 2,
    log_tail_retry_after_s: float = 5.0,
) -> ASGIApp:
    """Wrap ``app`` so each HTTP request's synchronous Django code runs on a reused thread of its lane
    (``lane_of``): ``threads`` for people, ``agent_threads`` for agents, ``log_tail_threads`` for log tails.

    People and agents wait for a thread of their lane in order of arrival; a log tail that finds every
    log-tail thread busy is answered 503 with ``Retry-After: log_tail_retry_after_s`` (rounded up). Other
    scopes (websockets, lifespan) pass through unchanged. Raises ValueError when a lane has fewer than 1
    thread.
    """
    sizes = {PEOPLE: threads, AGENTS: agent_threads, LOG_TAILS: log_tail_threads}
    for lane, size in sizes.items():
        if size < 1:
            raise ValueError(f"threads must be at least 1, not {size} ({lane})")
    names = {PEOPLE: "request", AGENTS: "agent-request", LOG_TAILS: "log-tail"}
    retry_after = str(max(1, math.ceil(log_tail_retry_after_s))).encode()
    busy = (
        f"{log_tail_threads} log tails are being read already; try again in {retry_after.decode()} s "
        "(FLOTILLA_API_LOG_TAIL_THREADS)"
    )
    pools: dict[str, ThreadPool] = {}  # made on first use, in the server's event loop

    async def pooled(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        if not pools:
            pools.update({lane: ThreadPool(size, names[lane]) for lane, size in sizes.items()})
        lane = lane_of(scope)
        pool = pools[lane]
        if lane == LOG_TAILS:
            executor = pool.try_acquire()
            if executor is None:
                await send_refusal(send, 503, busy, [(b"retry-after", retry_after)])
                return
        else:
            executor = await pool.acquire()
        try:
            async with ThreadSensitiveContext(executor=executor):
                await app(scope, receive, send)
        finally:
            pool.release(executor)

    return pooled
