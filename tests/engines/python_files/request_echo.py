"""A pystr function that answers with the request dict it was given, as JSON."""

import json
from collections.abc import AsyncIterator
from typing import Any


async def generate(request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    yield {"text": json.dumps(request, sort_keys=True), "finish_reason": "stop"}
