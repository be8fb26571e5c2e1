"""The control plane's ASGI application answers uvicorn's lifespan messages (issue 39)."""

from typing import Any

import pytest


@pytest.mark.django_db
async def test_the_application_acknowledges_start_up_and_shutdown() -> None:
    from controlplane.asgi import application  # importing it sets Django up

    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await application({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
    assert sent == [{"type": "lifespan.startup.complete"}, {"type": "lifespan.shutdown.complete"}]
