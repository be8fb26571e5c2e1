"""A decode request's vLLM stream, kept open until its first output when the request is stopped before it.

A decode worker's request that comes with a prefill worker's handoff first pulls the prompt's KV (NIXL reads
it from the prefill worker's GPU), then computes its first token. vLLM's engine core can crash when such a
request is aborted while the pull is in flight, so NVIDIA Dynamo defers that abort until the first output
(``_DeferredAbort`` in its vLLM worker). vLLM aborts a request as soon as its output stream is closed or the
task reading it is cancelled. So here the stream is read by a task of its own (``PulledStream``), and the
request's own task only reads what that task hands on. A request stopped before its first output (its client
gone, its task cancelled) leaves the reading task running until that output, or until ``deadline_s``, and only
then is the stream closed and the request aborted. Either way, no half-done pull holds blocks for ever.
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

#: How long a request stopped before its first output may take to get it (its KV pulled) before it is aborted
#: all the same.
PULL_DEADLINE_S = 60.0

_END = object()
#: The reading tasks of stopped requests still waiting for their first output: kept, or they could be collected.
_waiting: set["asyncio.Task[None]"] = set()


class PulledStream:
    """Reads ``stream`` (vLLM's outputs of request ``request_id``) on a task of its own; iterate it for the outputs,
    and ``close()`` it when done."""

    def __init__(
        self,
        stream: AsyncIterator[Any],
        abort: Callable[[str], Awaitable[None]],
        request_id: str,
        deadline_s: float = PULL_DEADLINE_S,
    ) -> None:
        self._abort = abort
        self._request_id = request_id
        self._deadline_s = deadline_s
        self._outputs: asyncio.Queue[Any] = asyncio.Queue()
        self.first_output = asyncio.Event()
        self._reader = asyncio.create_task(self._read(stream))

    async def _read(self, stream: AsyncIterator[Any]) -> None:
        try:
            async for output in stream:
                self.first_output.set()
                self._outputs.put_nowait(output)
        except Exception as exc:  # vLLM's error: the request's own task raises it
            self._outputs.put_nowait(exc)
        finally:
            self._outputs.put_nowait(_END)

    def __aiter__(self) -> "PulledStream":
        return self

    async def __anext__(self) -> Any:
        item = await self._outputs.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        return item

    def close(self, finished: bool) -> None:
        """Done reading: a request that finished needs nothing more; one stopped after its first output is aborted
        now (its reading task cancelled: vLLM aborts a request whose stream is cancelled); one stopped before it is
        aborted once the first output comes, or at the deadline, in the background."""
        if finished or self._reader.done():
            return
        if self.first_output.is_set():
            self._reader.cancel()
            return
        task = asyncio.create_task(self._abort_after_first_output())
        _waiting.add(task)
        task.add_done_callback(_waiting.discard)

    async def _abort_after_first_output(self) -> None:
        try:
            async with asyncio.timeout(self._deadline_s):
                await self.first_output.wait()
        except TimeoutError:
            log.warning(
                "request %s: stopped before its first output and still without one after %g s (its KV pull): "
                "aborted all the same",
                self._request_id,
                self._deadline_s,
            )
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        try:
            await self._abort(self._request_id)  # vLLM aborted it with its stream; this makes sure
        except Exception as exc:
            log.warning("request %s: vLLM's abort failed: %s", self._request_id, exc)
