"""How a client tells a dead or hung worker from a slow one: each stream's silence watchdog, and the
rule that turns probes answered "no responders" into a verdict."""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.msg import Msg

from runtime.loop_bound import SingleReaderQueue
from runtime.request_plane.wire import ERROR, NO_RESPONDERS, Frame, frame_decoder

log = logging.getLogger(__name__)

# Seconds of probes answered "no responders", back to back, before a worker counts as gone.
DEFAULT_GONE_AFTER = 1.0


class ProbeFailures:
    """The probes of each instance that NATS answered "no responders" (nobody listens), since its last answer.

    An instance counts as gone once such answers have come back to back for ``span`` seconds: a worker
    whose NATS connection drops for half a second reconnects and answers again, and cutting its streams
    at the first "no responders" would fail every one of them for a blip.
    """

    __slots__ = ("_first", "_span")

    def __init__(self, span: float) -> None:
        self._span = span
        self._first: dict[str, float] = {}  # instance subject -> when its first unanswered probe came back

    def failed(self, subject: str, now: float) -> bool:
        """Count a "no responders" answer at ``now``; return whether the instance now counts as gone."""
        first = self._first.setdefault(subject, now)
        return now - first >= self._span

    def clear(self, subject: str) -> None:
        """Start afresh: the instance answered a probe (it is there), or its streams were cut or closed."""
        self._first.pop(subject, None)


# How many silence timeouts a worker is given to answer the probe that confirms a silence.
LIVENESS_WAIT = 6

# How late a silence timer may fire before the client counts itself as behind (see Inbox).
_LOOP_LAG_TOLERANCE = 0.5


class Inbox:
    """Client side of one stream: frames queued by the subscription callback, with a silence watchdog.

    ``caught_up()`` says whether the client has read everything NATS had for it (a PING round trip:
    the server answers it after all it had queued for us). An overloaded ingress must not take its
    own backlog for a worker's silence and fail streams that are alive (their frames and heartbeats
    are waiting unread, in its own queue or in the server's buffers), so the verdict waits for it.
    """

    __slots__ = ("_caught_up", "_confirming", "_due", "_last", "_loop", "_running", "_silence", "_timer", "queue")

    def __init__(
        self,
        silence_timeout: float,
        caught_up: Callable[[], Awaitable[bool]],
        running: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self.queue: SingleReaderQueue[Frame | None] = SingleReaderQueue(self._loop)  # None: the worker went silent
        self._silence = silence_timeout
        self._caught_up = caught_up
        self._running = running
        self._confirming: asyncio.Task[None] | None = None
        self._last = time.monotonic()
        self._due = self._last + silence_timeout
        self._timer = self._loop.call_later(silence_timeout, self._check)

    def on_message(self, msg: Msg) -> None:
        self._last = time.monotonic()
        if not msg.data and msg.headers and msg.headers.get("Status") == "503":
            self.queue.put_nowait(NO_RESPONDERS)
            return
        try:
            self.queue.put_nowait(frame_decoder.decode(msg.data))
        except msgspec.DecodeError as exc:
            # Most likely a worker of another Flotilla version: fail the request now, not after a silence.
            log.warning("malformed frame on %s: %s", msg.subject, exc)
            self.queue.put_nowait(Frame(ERROR, -1, error=f"the worker sent a malformed frame ({exc})"))

    def _check(self) -> None:
        # One timer per silence period rather than one per message: re-armed for the time left.
        now = time.monotonic()
        # A timer that fires late means a busy event loop, which reads NATS late too.
        late = now - self._due > _LOOP_LAG_TOLERANCE
        if now - self._last >= self._silence and not late:
            self._confirming = self._loop.create_task(self._confirm(self._last))
        else:
            self._rearm(now)

    async def _confirm(self, last: float) -> None:
        """Call the silence once the client has caught up and nothing arrived, unless the worker says
        it runs the request (an overloaded worker is slow, not gone)."""
        silent = await self._caught_up() and self._last == last
        if silent and (self._running is None or not await self._running()):
            self.queue.put_nowait(None)
            return
        self._rearm(time.monotonic())

    def _rearm(self, now: float) -> None:
        quiet = now - self._last
        wait = self._silence - quiet if quiet < self._silence else self._silence / 4
        self._due = now + wait
        self._timer = self._loop.call_later(wait, self._check)

    def close(self) -> None:
        self._timer.cancel()
        if self._confirming is not None:
            self._confirming.cancel()
