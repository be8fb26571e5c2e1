"""A file whose import fails."""

from collections.abc import AsyncIterator

import flotilla_no_such_module  # noqa: F401


async def generate(request: dict[str, object]) -> AsyncIterator[str]:
    yield "never"
