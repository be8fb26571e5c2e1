"""Waiting for a server (etcd, NATS) at start-up, and telling the operator what is missing.

A process may start before its servers: a systemd unit at boot, a laptop without `make services`. It
keeps trying for as long as it takes (supervisors rely on that: exiting would only be restarted), but
never silently: within ``WARN_AFTER`` seconds it warns which server at which address does not answer
and how to start one, repeats that every ``REMIND_EVERY`` seconds, and says once when it connected.
"""

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from runtime.errors import FlotillaError

log = logging.getLogger(__name__)

T = TypeVar("T")

WARN_AFTER = 1.0
REMIND_EVERY = 5.0


class ServerWait:
    """The wait for one kind of server: what to call it, where it was looked for, why it failed last."""

    def __init__(
        self,
        kind: str,
        address: str,
        *,
        variable: str,
        error: type[FlotillaError],
        warn_after: float = WARN_AFTER,
        remind_every: float = REMIND_EVERY,
    ) -> None:
        self.kind = kind
        self.address = address
        self.variable = variable
        self.error = error
        self.warn_after = warn_after
        self.remind_every = remind_every
        self.last_failure = "no answer yet"

    def failed(self, exc: BaseException) -> None:
        """Note why the latest attempt failed (shown in the next warning)."""
        self.last_failure = str(exc) or type(exc).__name__

    def message(self) -> str:
        return (
            f"cannot reach {self.kind} at {self.address} ({self.last_failure}); "
            f"start one with `make services` or set {self.variable}"
        )

    async def wait(self, connecting: Awaitable[T], *, limit: float | None = None) -> T:
        """Await ``connecting`` (which retries by itself), warning and reminding while it has not finished.

        Returns its result. Raises ``self.error`` with ``message()`` once ``limit`` seconds have passed
        (None: never), or what ``connecting`` raised. Cancelling this cancels ``connecting``.
        """
        task = asyncio.ensure_future(connecting)
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = None if limit is None else start + limit
        pause = self.warn_after
        warned = False
        try:
            while True:
                if deadline is not None:
                    pause = min(pause, max(deadline - loop.time(), 0.0))
                await asyncio.wait([task], timeout=pause)
                if task.done():
                    break
                if deadline is not None and loop.time() >= deadline:
                    raise self.error(self.message())
                waited = loop.time() - start
                log.warning("%s; still trying after %.0f s", self.message(), waited)
                warned = True
                pause = self.remind_every
        finally:
            if not task.done():
                task.cancel()
                # wait() neither raises the task's CancelledError nor swallows a cancellation of our own.
                await asyncio.wait([task])
        result = task.result()
        if warned:
            # As loud as the warnings, so that whoever saw them also sees that they are over.
            log.warning("connected to %s at %s after %.1f s", self.kind, self.address, loop.time() - start)
        else:
            log.info("connected to %s at %s", self.kind, self.address)
        return result
