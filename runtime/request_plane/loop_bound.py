"""A wake-up and a queue for one waiter, bound to their event loop when made.

``asyncio.Event.wait()`` and ``asyncio.Queue.get()`` look up the running loop every time they have to
wait. On Python 3.11 that lookup is a ``getpid()`` system call (a check against ``fork``), and the
request plane waits once per streamed frame on each side: in a mocker worker under the trace replay
(bench/trace_replay.py), ``getpid`` took ~12% of the busy CPU samples (py-spy, native), most of it from
the stream's wake-up. These two take the loop once, when they are made (one lookup per request), and
then only create futures on it.

Each serves a single waiter at a time, which is how the request plane uses them: a stream's writer
waits for its wake-up, a stream's reader for its frames.
"""

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Wakeup:
    """An ``asyncio.Event`` for one waiter: ``set`` it, ``await wait()`` until it is set, ``clear`` it."""

    __slots__ = ("_flag", "_loop", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = asyncio.get_running_loop() if loop is None else loop
        self._flag = False
        self._waiter: asyncio.Future[None] | None = None

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        if self._flag:
            return
        self._flag = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def clear(self) -> None:
        self._flag = False

    async def wait(self) -> None:
        """Return once the flag is set (at once if it is). Raises RuntimeError if another task waits."""
        if self._flag:
            return
        if self._waiter is not None:
            raise RuntimeError("a Wakeup serves one waiter at a time")
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None


class SingleReaderQueue(Generic[T]):
    """An unbounded FIFO with one reader: ``put_nowait`` from anywhere on the loop, ``await get()``."""

    __slots__ = ("_items", "_ready")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._items: deque[T] = deque()
        self._ready = Wakeup(loop)  # set when an item arrives

    def qsize(self) -> int:
        return len(self._items)

    def put_nowait(self, item: T) -> None:
        self._items.append(item)
        self._ready.set()

    def first(self) -> T:
        """The oldest item, left in the queue. Raises IndexError if there is none."""
        return self._items[0]

    def get_nowait(self) -> T:
        """The oldest item, taken from the queue. Raises IndexError if there is none."""
        return self._items.popleft()

    async def get(self) -> T:
        """The oldest item, waiting for one if there is none. Raises RuntimeError if another task reads."""
        items = self._items
        while not items:
            self._ready.clear()
            try:
                await self._ready.wait()
            except RuntimeError:
                raise RuntimeError("a SingleReaderQueue serves one reader at a time") from None
        return items.popleft()
