"""A pytok function that yields one token and then fails."""

from collections.abc import AsyncIterator
from typing import Any


async def generate(request: dict[str, Any]) -> AsyncIterator[list[int]]:
    yield request["token_ids"][:1]
    raise RuntimeError("token function broke")
