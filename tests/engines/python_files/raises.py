"""A pystr function that fails on demand: a prompt containing "fail" raises, anything else is echoed."""

from collections.abc import AsyncIterator
from typing import Any


async def generate(request: dict[str, Any]) -> AsyncIterator[str]:
    text = request.get("prompt") or request["messages"][-1]["content"]
    if "fail" in text:
        yield "partial"
        raise ValueError("the user function gave up on purpose")
    yield text
