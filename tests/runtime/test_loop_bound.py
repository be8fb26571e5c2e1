"""runtime.request_plane.loop_bound: a one-waiter event and a one-reader queue that do not look the loop up per wait."""

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from runtime.request_plane.loop_bound import SingleReaderQueue, Wakeup


async def test_a_wakeup_set_before_the_wait_returns_at_once_and_stays_set_until_cleared() -> None:
    wakeup = Wakeup()
    wakeup.set()
    wakeup.set()  # setting twice is harmless
    await asyncio.wait_for(wakeup.wait(), 1)
    assert wakeup.is_set()
    wakeup.clear()
    assert not wakeup.is_set()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(wakeup.wait(), 0.05)


async def test_a_wakeup_wakes_its_waiter_and_survives_a_cancelled_wait() -> None:
    wakeup = Wakeup()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(wakeup.wait(), 0.02)  # cancelled: the next wait must still work
    waiter = asyncio.create_task(wakeup.wait())
    await asyncio.sleep(0)
    assert not waiter.done()
    wakeup.set()
    await asyncio.wait_for(waiter, 1)


async def test_a_wakeup_refuses_a_second_waiter() -> None:
    wakeup = Wakeup()
    first = asyncio.create_task(wakeup.wait())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="one waiter"):
        await wakeup.wait()
    wakeup.set()
    await first


async def test_the_queue_gives_items_in_order_and_waits_when_empty() -> None:
    queue: SingleReaderQueue[int | None] = SingleReaderQueue()
    queue.put_nowait(1)
    queue.put_nowait(2)
    assert queue.qsize() == 2
    assert [await queue.get(), await queue.get()] == [1, 2]
    reader = asyncio.create_task(queue.get())
    await asyncio.sleep(0)
    assert not reader.done()
    queue.put_nowait(None)
    assert await asyncio.wait_for(reader, 1) is None


async def test_a_cancelled_get_loses_nothing_and_a_second_reader_is_refused() -> None:
    queue: SingleReaderQueue[str] = SingleReaderQueue()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(queue.get(), 0.02)
    reader = asyncio.create_task(queue.get())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="one reader"):
        await queue.get()
    queue.put_nowait("frame")
    assert await reader == "frame"
    assert queue.qsize() == 0


async def test_the_queue_shows_and_takes_its_oldest_item_without_waiting() -> None:
    queue: SingleReaderQueue[str] = SingleReaderQueue()
    with pytest.raises(IndexError):
        queue.first()
    with pytest.raises(IndexError):
        queue.get_nowait()
    queue.put_nowait("a")
    queue.put_nowait("b")
    assert queue.first() == "a"
    assert queue.qsize() == 2
    assert queue.get_nowait() == "a"
    assert await queue.get() == "b"


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the Python-level running-loop lookups that asyncio's own primitives make."""
    calls = [0]
    original: Callable[[], Any] = asyncio.events._get_running_loop

    def counted() -> Any:
        calls[0] += 1
        return original()

    monkeypatch.setattr(asyncio.events, "_get_running_loop", counted)
    return calls


async def test_waiting_does_not_look_up_the_running_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    wakeup, queue = Wakeup(), SingleReaderQueue[int]()
    calls = _counting(monkeypatch)

    async def pass_around() -> None:
        for item in range(5):
            wakeup.clear()
            waiter = asyncio.ensure_future(wakeup.wait())
            await asyncio.sleep(0)
            wakeup.set()
            await waiter
            reader = asyncio.ensure_future(queue.get())
            await asyncio.sleep(0)
            queue.put_nowait(item)
            assert await reader == item

    await pass_around()
    assert calls[0] == 0
    # The check can fail: asyncio.Event looks the loop up on every wait.
    event = asyncio.Event()
    waiter = asyncio.ensure_future(event.wait())
    await asyncio.sleep(0)
    event.set()
    await waiter
    assert calls[0] >= 1
