"""Deadlines for clients too slow to serve: one that does not finish sending its request body, and one that
stops taking its response.

Without them a client holds what it was given for as long as it likes: a body that never ends holds its
connection and its place among its API key's concurrent requests; a stream nobody reads holds a generation
slot (admission) and its worker's stream, since uvicorn's ``send`` waits for the socket to drain.

* The body must arrive whole within ``body_timeout_s`` of the request's headers (bytes trickled in do not
  extend it), else a 408 and the connection is closed (``read_body`` in ``http_app``).
* A ``send`` that waits (the client's socket and the server's buffers are full) must complete within
  ``send_timeout_s``, else the client is dropped: its connection is aborted, which the request sees as a
  disconnect (its generation is stopped, the worker's stream cancelled, its slot freed). A client that
  reads slowly is not dropped, only one that takes nothing for that long.

One timer per request, not per send: it is armed by the first send and re-armed only when it fires, so a
streamed token costs two attribute writes.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import Any, Protocol

from frontend_gateway.errors import RequestTimeout
from frontend_gateway.metrics import GatewayMetrics
from runtime.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]

#: A client that has sent no more of its body within this many seconds of its headers gets a 408.
DEFAULT_BODY_TIMEOUT_S = 60.0
#: A client that took none of its response for this many seconds (a send waited as long) is dropped.
DEFAULT_SEND_TIMEOUT_S = 60.0


class SlowClients:
    """An app's two deadlines, and what it says of the clients they drop: each is counted in
    ``flotilla_frontend_slow_clients_dropped_total{reason}`` and logged (at most once a minute per reason)."""

    def __init__(self, metrics: GatewayMetrics, *, body_timeout_s: float, send_timeout_s: float) -> None:
        self._metrics = metrics
        #: A request body must arrive whole within this many seconds of its headers (else 408).
        self.body_timeout_s = body_timeout_s
        #: A client that takes none of its response for this many seconds is dropped.
        self.send_timeout_s = send_timeout_s
        # One log per reason: a burst of stalled bodies must not hide that streams are dropped too.
        self._logs = {reason: RateLimitedLog(log, period_s=60.0) for reason in ("head", "body", "send")}

    def dropped_head(self, client: str, head_timeout_s: float) -> None:
        """Count and log a client whose request head did not arrive in time (head_deadline.py drops it)."""
        self._metrics.slow_client_dropped("head")
        self._logs["head"].warning(
            f"dropped {client}: its request headers did not arrive within {head_timeout_s:g} s (--header-timeout)"
        )

    async def body_within_deadline(self, scope: Scope, read: Coroutine[Any, Any, bytes]) -> bytes:
        """What ``read`` (of the request's body) returns; raises RequestTimeout (408, the connection then
        closed) when it takes longer than ``body_timeout_s``."""
        try:
            async with asyncio.timeout(self.body_timeout_s):
                return await read
        except TimeoutError:
            self._dropped(scope, "body")
            raise RequestTimeout(
                f"the request body did not arrive within {self.body_timeout_s:g} s of its headers; the "
                "connection is closed"
            ) from None

    def watch_sends(self, scope: Scope, send: Send) -> "SendDeadline":
        """``send`` held to the send deadline: the request sends through the result's ``send``, and closes it."""
        return SendDeadline(send, self.send_timeout_s, lambda: self._dropped(scope, "send"))

    def _dropped(self, scope: Scope, reason: str) -> None:
        self._metrics.slow_client_dropped(reason)
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "a client"
        if reason == "body":
            why = f"its request body did not arrive within {self.body_timeout_s:g} s (--body-timeout): 408"
        else:
            why = f"it took none of its response for {self.send_timeout_s:g} s (--send-timeout): disconnected"
        self._logs[reason].warning(f"dropped {who} ({scope['method']} {scope['path'][:200]}): {why}")


class _Abortable(Protocol):
    def abort(self) -> None: ...


class SendDeadline:
    """Wraps a request's ``send``: drops the client when one send waits longer than ``timeout_s``.

    ``on_drop`` is told first (for a metric and a log line). The connection is then aborted (uvicorn's
    request cycle holds it): the request's pending send returns and its receive says ``http.disconnect``,
    as when the client leaves. Under a server whose connection cannot be reached, the request's task is
    cancelled instead; ``dropped`` tells its handler why.
    """

    __slots__ = ("_loop", "_on_drop", "_owner", "_send", "_since", "_timeout_s", "_timer", "dropped")

    def __init__(self, send: Send, timeout_s: float, on_drop: Callable[[], None]) -> None:
        self._send = send
        self._timeout_s = timeout_s
        self._on_drop = on_drop
        self._loop = asyncio.get_running_loop()
        self._owner = asyncio.current_task()
        self._since: float | None = None  # when the send in progress began; None: none is
        self._timer: asyncio.TimerHandle | None = None
        self.dropped = False

    async def send(self, message: Message) -> None:
        self._since = since = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(since + self._timeout_s, self._check)
        try:
            await self._send(message)
        finally:
            self._since = None

    def close(self) -> None:
        """Stop watching (the request is over)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        since = self._since
        if since is None or self.dropped:
            return  # no send waits: the next one arms the timer again
        due = since + self._timeout_s
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._check)
            return
        self.dropped = True
        self._on_drop()
        connection = _connection_of(self._send)
        if connection is not None:
            connection.abort()  # not close(): that would wait for the unread bytes to drain, forever
        elif self._owner is not None:
            self._owner.cancel()


def _connection_of(send: Send) -> _Abortable | None:
    """The transport under uvicorn's ``send``, a method of its request cycle, which holds it: ASGI has no
    message that aborts a connection."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    return transport if callable(getattr(transport, "abort", None)) else None
