"""Supervised background tasks: none of a process's owned tasks may die unnoticed.

A task that ends with an exception is logged with its traceback, then either restarted after a
backoff (``restart=True``: it is rebuilt from its coroutine factory) or reported as fatal, which
records the failure and calls ``on_fatal`` so that the process shuts down and exits non-zero.
A task that returns normally, or is cancelled, simply ends.
"""

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from runtime.backoff import Backoff

log = logging.getLogger(__name__)

TaskFactory = Callable[[], Coroutine[Any, Any, None]]

RESTART_DELAY_MIN, RESTART_DELAY_MAX = 0.1, 5.0
# A run this long counts as healthy: the next crash restarts after the shortest delay again.
HEALTHY_RUN_S = 30.0


class Supervisor:
    """Owns background tasks until ``close()``; ``failure`` says why the first fatal one died."""

    def __init__(self, on_fatal: Callable[[], None]) -> None:
        self._on_fatal = on_fatal
        self._tasks: set[asyncio.Task[None]] = set()
        self.failure: str | None = None

    @property
    def running(self) -> int:
        """How many owned tasks have not ended."""
        return len(self._tasks)

    def own_task(self, task: asyncio.Task[None]) -> None:
        """Keep a running task; an exception from it is fatal (there is nothing to restart it from)."""
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def own(self, factory: TaskFactory, *, name: str, restart: bool) -> None:
        """Run ``factory()`` as a task named ``name``; on an exception restart it, or fail if not ``restart``."""
        coroutine = restarting(factory, name) if restart else factory()
        self.own_task(asyncio.create_task(coroutine, name=name))

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        log.error("background task %r failed; shutting down", task.get_name(), exc_info=exc)
        if self.failure is None:
            self.failure = f"background task {task.get_name()!r} failed: {type(exc).__name__}: {exc}"
        self._on_fatal()

    def cancel(self) -> None:
        """Cancel every owned task now, without waiting (``close`` waits for them): one owner stopping
        several supervisors cancels them all before its first wait lets any of their tasks run."""
        for task in self._tasks:
            task.remove_done_callback(self._task_done)
            task.cancel()

    async def close(self) -> None:
        """Cancel every owned task and wait for them to end."""
        self.cancel()
        tasks = list(self._tasks)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        for task, result in zip(tasks, results, strict=True):
            # A task that failed while being cancelled (in its cleanup) would go unseen otherwise.
            if isinstance(result, Exception):
                log.error("background task %r failed while stopping", task.get_name(), exc_info=result)


async def restarting(factory: TaskFactory, name: str) -> None:
    """Run ``factory()`` until it returns; each time it raises, log the traceback and run it again after
    a backoff. For a task its owner holds and cancels itself (a server's loops): it dies only when cancelled."""
    backoff = Backoff(RESTART_DELAY_MIN, RESTART_DELAY_MAX)
    while True:
        started = time.monotonic()
        try:
            await factory()
            return
        except Exception:
            if time.monotonic() - started >= HEALTHY_RUN_S:
                backoff.reset()
            delay = backoff.next()
            log.exception("background task %r failed; restarting it in %.1f s", name, delay)
        await asyncio.sleep(delay)
