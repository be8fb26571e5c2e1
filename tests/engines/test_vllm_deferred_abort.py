"""A decode request's vLLM stream is aborted only once its first output came (engines/vllm/deferred_abort.py):
stopped before it, the request is aborted when it comes or at the deadline; stopped after it, at once; run to its
end, never. The stand-in behaves as vLLM's AsyncLLM.generate does: closing or cancelling its stream aborts the
request there and then."""

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from engines.vllm.deferred_abort import PulledStream


class StandInVllm:
    """Outputs 0, 1, 2 once ``pulled`` is set (the KV pull over); records each abort and whether the pull was over."""

    def __init__(self) -> None:
        self.pulled = asyncio.Event()
        self.aborts: list[tuple[str, bool]] = []
        self._recorded = asyncio.Condition()

    def _record(self, request_id: str) -> None:
        self.aborts.append((request_id, self.pulled.is_set()))
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._recorded:
            self._recorded.notify_all()

    async def wait_for_aborts(self, count: int) -> None:
        async with asyncio.timeout(5), self._recorded:
            await self._recorded.wait_for(lambda: len(self.aborts) >= count)

    async def generate(self, request_id: str) -> AsyncIterator[int]:
        try:
            await self.pulled.wait()
            for output in range(3):
                yield output
                await asyncio.sleep(0.01)
        except (asyncio.CancelledError, GeneratorExit):
            self._record(request_id)  # vLLM: abort when the stream goes
            raise

    async def abort(self, request_id: str) -> None:
        self._record(request_id)


async def consume(pulled: PulledStream, count: int | None = None) -> list[int]:
    """The request's own task: reads ``count`` outputs (all: None), then closes."""
    seen: list[int] = []
    finished = False
    try:
        async for output in pulled:
            seen.append(output)
            if count is not None and len(seen) == count:
                return seen
        finished = True
        return seen
    finally:
        pulled.close(finished)


async def test_a_request_stopped_before_its_first_output_is_aborted_only_once_it_comes() -> None:
    vllm = StandInVllm()
    pulled = PulledStream(vllm.generate("r"), vllm.abort, "r")
    request = asyncio.create_task(consume(pulled))
    await asyncio.sleep(0.05)
    request.cancel()  # the client left while the KV was being pulled
    await asyncio.gather(request, return_exceptions=True)
    await asyncio.sleep(0.05)
    assert vllm.aborts == []  # nothing aborted while the pull is in flight
    vllm.pulled.set()
    await vllm.wait_for_aborts(2)
    assert vllm.aborts == [("r", True), ("r", True)]  # its stream cancelled, then abort() to make sure


async def test_a_pull_that_never_ends_is_aborted_at_the_deadline(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="engines.vllm.deferred_abort")
    vllm = StandInVllm()
    pulled = PulledStream(vllm.generate("r"), vllm.abort, "r", deadline_s=0.2)
    request = asyncio.create_task(consume(pulled))
    await asyncio.sleep(0.05)
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)
    await vllm.wait_for_aborts(2)
    assert vllm.aborts == [("r", False), ("r", False)]
    assert "still without one after 0.2 s (its KV pull): aborted all the same" in caplog.text


async def test_a_request_stopped_after_its_first_output_is_aborted_at_once_and_one_run_to_its_end_never() -> None:
    vllm = StandInVllm()
    vllm.pulled.set()
    stopped = PulledStream(vllm.generate("a"), vllm.abort, "a")
    assert await consume(stopped, count=1) == [0]
    await vllm.wait_for_aborts(1)
    assert vllm.aborts == [("a", True)]

    whole = PulledStream(vllm.generate("b"), vllm.abort, "b")
    assert await consume(whole) == [0, 1, 2]
    await asyncio.sleep(0.05)
    assert [request for request, _ in vllm.aborts] == ["a"]  # "b" ran to its end: nothing to abort


async def test_vllms_error_reaches_the_request() -> None:
    async def failing() -> AsyncIterator[int]:
        yield 0
        raise ValueError("bad parameter")

    async def abort(request_id: str) -> None:
        raise AssertionError("nothing to abort: vLLM ended the request")

    pulled = PulledStream(failing(), abort, "r")
    with pytest.raises(ValueError, match="bad parameter"):
        await consume(pulled)
