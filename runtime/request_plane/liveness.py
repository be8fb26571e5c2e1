"""How a client tells a dead or hung worker from a slow one: each stream's silence and progress watchdogs,
and the rule that turns probes answered "no responders" into a verdict."""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.msg import Msg

from runtime.request_plane.loop_bound import SingleReaderQueue
from runtime.request_plane.wire import DATA, ERROR, HEARTBEAT, NO_RESPONDERS, Frame, frame_decoder

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


# How many silence timeouts a worker is given to answer the probe that confirms a silence, when other
# streams show it alive (it is slow: an overloaded worker answered 5 s late at 4096 streams), and when
# it is silent on every stream of this client too (it is hung, or frozen, with its connection open).
LIVENESS_WAIT = 6
HUNG_WAIT = 0.5

# How late a silence timer may fire before the client counts itself as behind (see Inbox).
_LOOP_LAG_TOLERANCE = 0.5

# What the progress watchdog puts in an inbox's queue: the stream's engine made no progress in time.
STALLED = Frame(ERROR, 0, error="stalled")
# What the silence watchdog puts there when the worker, silent on a stream it never sent a frame of, answers
# that it does not run the request: it never took it (lost on its way in, as the worker stopped taking
# requests), so nothing was generated and another instance may take it as if this one had refused it.
NOT_TAKEN = Frame(ERROR, 0, error="not taken")


class Inbox:
    """Client side of one stream: frames queued by the subscription callback, with a silence watchdog
    and, given a ``progress_deadline``, a progress watchdog.

    ``caught_up()`` says whether the client has read everything NATS had for it (a PING round trip:
    the server answers it after all it had queued for us). An overloaded ingress must not take its
    own backlog for a worker's silence and fail streams that are alive (their frames and heartbeats
    are waiting unread, in its own queue or in the server's buffers), so the verdict waits for it.

    Heartbeats prove that the worker's event loop runs, not that its engine does. The progress
    watchdog stalls a stream (STALLED in its queue) that waited ``progress_deadline`` s with nothing
    unread: between two outputs, for an output of its own; before its first, for an output of the
    worker on any stream (the heartbeats carry the worker's count of them), since a request queued
    behind others waits its turn while the engine works. A stream whose window is full waits for its
    reader, not its worker: its outputs are unread here, or were just acknowledged (``read()``).
    """

    __slots__ = (
        "_caught_up",
        "_confirming",
        "_deadline",
        "_due",
        "_heard",
        "_last",
        "_loop",
        "_on_stall",
        "_progress",
        "_progress_due",
        "_running",
        "_silence",
        "_stall_check",
        "_started",
        "_timer",
        "_watchdog",
        "_worker_progress",
        "queue",
        "stalled",
    )

    def __init__(
        self,
        silence_timeout: float,
        caught_up: Callable[[], Awaitable[bool]],
        running: Callable[[], Awaitable[bool | None]] | None = None,
        *,
        progress_deadline: float = 0.0,
        on_stall: Callable[[], None] | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        # None: the worker went silent; NOT_TAKEN: it never took the request
        self.queue: SingleReaderQueue[Frame | None] = SingleReaderQueue(self._loop)
        self._silence = silence_timeout
        self._caught_up = caught_up
        self._running = running
        self._confirming: asyncio.Task[None] | None = None
        self._last = time.monotonic()
        self._heard = False  # a frame of this stream arrived (a heartbeat, an output, an error)
        self._due = self._last + silence_timeout
        self._timer = self._loop.call_later(silence_timeout, self._check)
        self._deadline = progress_deadline
        self._on_stall = on_stall
        # When the wait for the next output began: the request's sending, its last output, the reader's
        # last ack, or (before the first output) the worker's last output on any stream.
        self._progress = self._last
        self._started = False  # an output of this stream arrived
        self._worker_progress = -1
        self.stalled = False
        self._stall_check: asyncio.Task[None] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._progress_due = self._last + progress_deadline
        if progress_deadline > 0:
            self._watchdog = self._loop.call_later(progress_deadline, self._check_progress)

    @property
    def last_heard(self) -> float:
        """When the worker last sent anything on this stream (monotonic seconds)."""
        return self._last

    def on_message(self, msg: Msg) -> None:
        now = self._last = time.monotonic()
        self._heard = True
        if not msg.data and msg.headers and msg.headers.get("Status") == "503":
            self.queue.put_nowait(NO_RESPONDERS)
            return
        try:
            frame = frame_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            # Most likely a worker of another Flotilla version: fail the request now, not after a silence.
            log.warning("malformed frame on %s: %s", msg.subject, exc)
            self.queue.put_nowait(Frame(ERROR, -1, error=f"the worker sent a malformed frame ({exc})"))
            return
        kind = frame.kind
        if kind == DATA:
            self._progress = now
            self._started = True
        elif kind == HEARTBEAT and not self._started and frame.progress != self._worker_progress:
            if self._worker_progress >= 0:
                self._progress = now  # the engine works for others while this request waits its turn
            self._worker_progress = frame.progress
        self.queue.put_nowait(frame)

    def read(self) -> None:
        """The reader acknowledged outputs: a worker whose window was full may send again from now."""
        self._progress = time.monotonic()

    def waited(self, now: float) -> float:
        """Seconds this stream has waited for its worker's next output; 0 while outputs wait unread."""
        return 0.0 if self.queue.qsize() or self.stalled else now - self._progress

    def stall(self) -> None:
        """Fail the stream as stalled (once)."""
        if not self.stalled:
            self.stalled = True
            self.queue.put_nowait(STALLED)

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
        it runs the request (an overloaded worker is slow, not gone); NOT_TAKEN if it says it does not
        and never sent a frame of it."""
        if await self._caught_up() and self._last == last:
            running = None if self._running is None else await self._running()
            if running is not True:
                self.queue.put_nowait(NOT_TAKEN if running is False and not self._heard else None)
                return
        self._rearm(time.monotonic())

    def _rearm(self, now: float) -> None:
        quiet = now - self._last
        wait = self._silence - quiet if quiet < self._silence else self._silence / 4
        self._due = now + wait
        self._timer = self._loop.call_later(wait, self._check)

    def _check_progress(self) -> None:
        # Like the silence timer: one timer per deadline, re-armed for the time left.
        now = time.monotonic()
        late = now - self._progress_due > _LOOP_LAG_TOLERANCE
        if self.waited(now) >= self._deadline and not late:
            self._stall_check = self._loop.create_task(self._confirm_stall(self._progress))
        else:
            self._rearm_progress(now)

    async def _confirm_stall(self, progress: float) -> None:
        """Stall the stream once the client has caught up and still no output came (an ingress that reads
        NATS late must not blame the worker)."""
        if await self._caught_up() and self._progress == progress and self.waited(time.monotonic()) > 0:
            self.stall()
            if self._on_stall is not None:
                self._on_stall()
            return
        self._rearm_progress(time.monotonic())

    def _rearm_progress(self, now: float) -> None:
        waited = self.waited(now)
        wait = self._deadline - waited if waited < self._deadline else self._deadline / 4
        self._progress_due = now + wait
        self._watchdog = self._loop.call_later(wait, self._check_progress)

    def close(self) -> None:
        self._timer.cancel()
        if self._watchdog is not None:
            self._watchdog.cancel()
        for task in (self._confirming, self._stall_check):
            if task is not None:
                task.cancel()
