"""The node agent's background tasks (heartbeats, comparisons, each instance's start or stop).

An asyncio task that nobody awaits keeps its exception to itself, and one that nobody references may be
garbage-collected mid-run; these are kept until they end, and a failure is logged with its traceback.
Unlike runtime/supervision.py's Supervisor, a failure is not fatal: one instance's failed start must not
stop the agent, which still has every other worker to look after.
"""

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)


class OwnedTasks:
    """Tasks kept until they end; ``cancel_all()`` ends those still running."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coroutine: Coroutine[Any, Any, None], *, name: str) -> "asyncio.Task[None]":
        task = asyncio.create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    async def cancel_all(self) -> None:
        """Cancel every task still running and wait for them to end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _finished(self, task: "asyncio.Task[None]") -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("%s failed: %s", task.get_name(), error, exc_info=error)
