"""The NATS connection of a process: connected once, reconnecting for ever after a loss."""

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS

from runtime.errors import RequestPlaneUnavailable

log = logging.getLogger(__name__)


async def connect_nats(url: str, *, name: str, on_event: Callable[[str], Awaitable[None]] | None = None) -> NATS:
    """Connect to NATS, reconnecting for ever after a loss (nats-py re-subscribes by itself).

    Raises RequestPlaneUnavailable when the first connection fails.
    """

    nc = NATS()

    async def note(kind: str) -> None:
        # Draining on a clean shutdown also "disconnects": only an unexpected loss is a warning.
        level = logging.DEBUG if nc.is_draining or nc.is_closed else logging.WARNING
        log.log(level, "NATS %s (%s)", kind, url)
        if on_event is not None:
            await on_event(kind)

    async def disconnected() -> None:
        await note("disconnected")

    async def reconnected() -> None:
        await note("reconnected")

    async def error(exc: Exception) -> None:
        log.debug("NATS error: %s", exc)

    options: dict[str, Any] = {
        "name": name,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "connect_timeout": 2,
        "disconnected_cb": disconnected,
        "reconnected_cb": reconnected,
        "error_cb": error,
    }
    try:
        await nc.connect(url, **options)
    except (TimeoutError, nats.errors.NoServersError, OSError) as exc:
        raise RequestPlaneUnavailable(
            f"cannot reach NATS at {url}; start it with `make services` or set NATS_SERVER"
        ) from exc
    return nc
