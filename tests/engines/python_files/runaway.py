"""A pystr function that never ends on its own: Flotilla must stop it at max_tokens."""

from collections.abc import AsyncIterator
from typing import Any


async def generate(request: dict[str, Any]) -> AsyncIterator[str]:
    while True:
        yield "x"
