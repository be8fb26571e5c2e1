"""Reading TensorRT-LLM's iteration results (KV events, iteration stats) for the worker's life.

``LLM.get_kv_cache_events_async(timeout)`` and ``LLM.get_stats_async(timeout)`` hand out the executor's
``IterationResult`` (tensorrt_llm/executor/result.py), an async iterator over a queue that the executor creates
on the first ``generate_async`` (``GenerationExecutor._maybe_initialize_iteration_results``,
tensorrt_llm/executor/executor.py). Before that, the events call fails an assertion and the stats call prints a
line and gives nothing. The iterator ends after ``timeout`` seconds without an item and stays ended until the
next ``generate_async`` marks it undone. So the worker starts a reader after its first ``generate_async``, as
Dynamo's TensorRT-LLM worker starts its publisher after the first output (``HandlerBase.generate_locally``),
and each reader asks again whenever the iterator ends, backing off while there is nothing, and logs what goes
wrong (at most a line a minute) without stopping, as Dynamo's ``Publisher._polling_loop`` does.
"""

import asyncio
import logging
from collections.abc import AsyncIterable, Callable
from typing import Any

from runtime.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)

#: The shortest and longest pause between two asks that brought nothing.
IDLE_PAUSE_S = (0.05, 1.0)


async def read_for_good(
    what: str,
    ask: Callable[[], AsyncIterable[dict[str, Any]]],
    handle: Callable[[dict[str, Any]], None],
    *,
    reading: Callable[[], bool],
) -> None:
    """Ask for ``what`` with ``ask`` and pass each item to ``handle`` for as long as ``reading()`` holds.

    An error from ``ask``, from the iterator or from ``handle`` is logged and reading goes on: the item that
    raised is lost, the ones after it are read at the next ask."""
    errors = RateLimitedLog(log, period_s=60.0)
    shortest, longest = IDLE_PAUSE_S
    pause = shortest
    while reading():
        got = False
        try:
            async for item in ask():
                got = True
                handle(item)
        except Exception as exc:  # TensorRT-LLM raises what its queues and IPC raise; a malformed item too
            errors.warning(f"reading TensorRT-LLM's {what} failed ({exc!r}); reading on")
        if got:
            pause = shortest
            continue
        await asyncio.sleep(pause)
        pause = min(pause * 2, longest)
