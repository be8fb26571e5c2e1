"""engines.mocker.precise_sleep: sleeps that end at their deadline, not at the loop's next millisecond tick."""

import asyncio
import sys
import time
from collections.abc import AsyncIterator

import pytest
import uvloop

from engines.mocker.precise_sleep import PreciseSleeper

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="timerfd exists on Linux only")


@pytest.fixture
async def sleeper() -> AsyncIterator[PreciseSleeper]:
    sleeper = PreciseSleeper()
    yield sleeper
    sleeper.close()


@linux_only
def test_on_linux_sleeps_use_a_timerfd(sleeper: PreciseSleeper) -> None:
    assert sleeper.precise


async def test_never_returns_before_the_deadline(sleeper: PreciseSleeper) -> None:
    for delay in (0.0003, 0.002, 0.0061):  # below, at and above a millisecond tick
        deadline = time.monotonic() + delay
        await sleeper.sleep_until(deadline)
        assert time.monotonic() >= deadline


async def test_a_deadline_already_passed_returns(sleeper: PreciseSleeper) -> None:
    await asyncio.wait_for(sleeper.sleep_until(time.monotonic() - 1.0), timeout=5)


async def test_other_tasks_run_while_it_sleeps(sleeper: PreciseSleeper) -> None:
    ran: list[str] = []

    async def other() -> None:
        ran.append("other")

    task = asyncio.create_task(other())
    await sleeper.sleep_until(time.monotonic() + 0.005)
    assert ran == ["other"]
    await task


async def test_a_cancelled_sleep_leaves_the_sleeper_usable(sleeper: PreciseSleeper) -> None:
    sleeping = asyncio.create_task(sleeper.sleep_until(time.monotonic() + 60))
    await asyncio.sleep(0.01)
    sleeping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sleeping
    deadline = time.monotonic() + 0.002
    await asyncio.wait_for(sleeper.sleep_until(deadline), timeout=5)
    assert time.monotonic() >= deadline


async def test_a_second_sleeper_task_is_refused(sleeper: PreciseSleeper) -> None:
    if not sleeper.precise:
        pytest.skip("the asyncio.sleep fallback has no shared timer to guard")
    first = asyncio.create_task(sleeper.sleep_until(time.monotonic() + 0.05))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="one task at a time"):
        await sleeper.sleep_until(time.monotonic() + 0.05)
    await first


async def test_after_close_it_falls_back_to_asyncio_sleep() -> None:
    sleeper = PreciseSleeper()
    await sleeper.sleep_until(time.monotonic() + 0.001)
    sleeper.close()
    sleeper.close()  # twice is harmless
    assert not sleeper.precise
    deadline = time.monotonic() + 0.002
    await sleeper.sleep_until(deadline)
    assert time.monotonic() >= deadline - 0.001  # asyncio's timers may round a little early


def test_one_sleeper_serves_one_loop_after_another() -> None:
    sleeper = PreciseSleeper()

    async def nap() -> float:
        deadline = time.monotonic() + 0.002
        await sleeper.sleep_until(deadline)
        return time.monotonic() - deadline

    try:
        assert asyncio.run(nap()) >= 0
        assert uvloop.run(nap()) >= 0  # the descriptor moved to the new loop
    finally:
        sleeper.close()
