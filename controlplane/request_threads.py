"""Run the control plane's HTTP requests on a few reused threads instead of a new thread each.

Django's ASGI handler runs each request's synchronous code in a ``ThreadSensitiveContext`` of its own:
a new thread per request, hence a new database connection per request, and no bound on how many run at
once. Under 200 agents heartbeating, requests waiting on SQLite's write lock became ~140 threads
fighting for the GIL while the lock holder waited for it (docs/benchmarks.md). Entering a context with
our own single-thread executor first makes Django's inner context a no-op: the request runs on one of
``threads`` long-lived threads, each keeping its database connection (``CONN_MAX_AGE=None``), and the
requests beyond them wait in the event loop, costing nothing.
"""

import asyncio
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import ThreadSensitiveContext

from controlplane.body_limit import ASGIApp, Receive, Scope, Send


def on_request_threads(app: ASGIApp, threads: int) -> ASGIApp:
    """Wrap ``app`` so each HTTP request's synchronous Django code runs on one of ``threads`` reused threads.

    Other scopes (websockets, lifespan) pass through unchanged.
    """
    if threads < 1:
        raise ValueError(f"threads must be at least 1, not {threads}")
    idle: asyncio.Queue[ThreadPoolExecutor] | None = None  # made in the server's event loop, on first use

    async def pooled(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal idle
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        if idle is None:
            idle = asyncio.Queue()
            for number in range(threads):
                idle.put_nowait(ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"request-{number}"))
        executor = await idle.get()
        try:
            async with ThreadSensitiveContext(executor=executor):
                await app(scope, receive, send)
        finally:
            idle.put_nowait(executor)

    return pooled
