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


#: The router asks a new instance for its cache state and holds the instance's events until the answer, or
#: until it has asked 5 times over 3.75 s (frontend_gateway/routing/kv_subscriber.py: STATE_RETRY_DELAYS_S).
#: Where no test worker answers, and what is tested is what the events do, the asks are retried at once instead, so each
#: test does not wait 3.75 s; test_kv_state_sync.py tests the asking itself.
QUICK_STATE_RETRIES = (0.01, 0.01, 0.01, 0.01)
