"""A pytok engine that gets stuck: it answers with the prompt's tokens, one every 20 ms, and on a worker
started with ``STUCK_AFTER=N`` it stops after N tokens of a request, for ever, while its worker's event
loop runs on (its heartbeats keep coming): an engine thread hung inside a step."""

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any


async def generate(request: dict[str, Any]) -> AsyncIterator[list[int]]:
    stuck_after = int(os.environ.get("STUCK_AFTER", "0"))
    tokens = request["token_ids"]
    for index in range(request["stop_conditions"]["max_tokens"]):
        if stuck_after and index == stuck_after:
            await asyncio.Event().wait()
        await asyncio.sleep(0.02)
        yield [tokens[index % len(tokens)]]
