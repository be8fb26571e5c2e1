"""Waiting, in tests, for what a router (or a model watcher) hears over NATS."""

import asyncio
from collections.abc import Callable
from typing import Protocol


class Listening(Protocol):
    """Sets ``changed`` after every message it hears (KvRouter, ModelWatcher)."""

    @property
    def changed(self) -> asyncio.Event: ...


async def until(listener: Listening, condition: Callable[[], bool], within_s: float = 10) -> None:
    """Wait until ``condition`` holds, looking again after each message ``listener`` hears."""
    async with asyncio.timeout(within_s):
        while True:
            listener.changed.clear()
            if condition():
                return
            await listener.changed.wait()
