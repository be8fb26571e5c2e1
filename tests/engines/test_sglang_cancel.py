"""A request the client leaves is aborted in SGLang by its rid, answered yet or not, and again while SGLang holds
it: against the stand-in of tests/engines/test_sglang.py (SGLang's ``TokenizerManager.abort_request`` and
``rid_to_state``, python/sglang/srt/managers/tokenizer_manager.py)."""

import asyncio

from engines.sglang.engine import SglangEngine
from runtime.engine import RequestContext
from tests.engines.test_sglang import FakeSglang, request, started_engine


async def queued_then_cancelled(engine: SglangEngine, fake: FakeSglang) -> str:
    """Start a request that waits in SGLang's queue, cancel its consumer (the request plane does when the client
    leaves), and return the rid the worker gave SGLang."""

    async def consume() -> None:
        async for _ in engine.generate(request(), RequestContext("r1")):
            pass

    fake.sent.clear()
    task = asyncio.create_task(consume())
    await fake.sent.wait()  # sent to the scheduler, nothing answered yet
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    rid: str = fake.calls[0]["rid"]
    return rid


async def test_a_client_that_leaves_before_the_first_token_aborts_the_queued_request_by_its_rid() -> None:
    fake = FakeSglang([], queued=True)
    engine = started_engine(fake)
    rid = await queued_then_cancelled(engine, fake)
    assert rid.startswith("r1-")  # the request's id, unique per attempt
    assert fake.aborted == [rid] and fake.tokenizer_manager.rid_to_state == {}


async def test_an_abort_that_reaches_the_scheduler_before_its_request_is_sent_again_until_sglang_lets_go() -> None:
    """With pipeline parallelism or attention DP the abort may reach the scheduler first and be lost; Dynamo's
    backend sends it again while ``rid_to_state`` holds the request (cancellation.py, ``_retry_abort``)."""
    fake = FakeSglang([], queued=True)
    fake.tokenizer_manager.lost_aborts = 2
    engine = started_engine(fake)
    rid = await queued_then_cancelled(engine, fake)
    assert engine._aborts is not None
    await engine._aborts.wait()
    assert fake.aborted == [rid, rid, rid] and fake.tokenizer_manager.rid_to_state == {}


async def test_two_attempts_of_one_request_have_rids_of_their_own() -> None:
    """SGLang refuses a rid it holds already; a migrated request may come back to the same worker."""
    fake = FakeSglang([], queued=True)
    engine = started_engine(fake)
    first = await queued_then_cancelled(engine, fake)
    fake.calls.clear()
    assert await queued_then_cancelled(engine, fake) != first
