"""The ingress's side of the request plane: a request sent to one instance, its answer streamed back."""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Coroutine
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from runtime.cluster.nats_connection import flush
from runtime.request_plane.errors import (
    RemoteError,
    RequestRefused,
    RequestTooLarge,
    StreamBroken,
    StreamStalled,
    WorkerBusy,
    WorkerUnavailable,
)
from runtime.request_plane.flow import AckBatcher, take_following
from runtime.request_plane.liveness import (
    DEFAULT_GONE_AFTER,
    HUNG_WAIT,
    LIVENESS_WAIT,
    NOT_TAKEN,
    STALLED,
    Inbox,
    ProbeFailures,
)
from runtime.request_plane.wire import (
    BUSY,
    CUT,
    DATA,
    DEFAULT_WINDOW,
    END,
    HEARTBEAT,
    NO_RESPONDERS,
    REJECTED,
    TOO_LARGE,
    UNAVAILABLE,
    Envelope,
    Frame,
    Probe,
    Stop,
    control_subject,
    encode,
    unknown_decoder,
)
from runtime.supervision import restarting

log = logging.getLogger(__name__)

#: Seconds an instance whose streams were cut (its connection is gone) or stalled (its engine is stuck)
#: gets no new request from this client, unless no other instance is left (``avoided``).
AVOID_S = 60.0


class RequestClient:
    """Sends requests to instance subjects and streams their answers.

    All answers arrive on one wildcard subscription (``<inbox>.*``) and are dispatched by subject,
    so a request costs no SUB/UNSUB round of its own.
    """

    def __init__(
        self,
        nc: NATS,
        *,
        silence_timeout: float = 5.0,
        window: int = DEFAULT_WINDOW,
        ack_interval: float = 0.005,
        probe_interval: float = 0.4,
        gone_after: float = DEFAULT_GONE_AFTER,
        progress_deadline: float = 0.0,
    ) -> None:
        self._nc = nc
        self.silence_timeout = silence_timeout
        self.window = max(1, window)
        self._ack_every = max(1, self.window // 4)
        self.probe_interval = probe_interval
        # Short, so that a probe the worker took just before dying does not hold up the next one long.
        self._probe_timeout = min(silence_timeout, max(1.0, 2 * probe_interval))
        self._prefix = nc.new_inbox()
        self._inboxes: dict[str, Inbox] = {}
        self._subscription: Subscription | None = None
        self._next = 0
        # Open streams by instance subject (reply subject -> request id): what the probes watch.
        self._open: dict[str, dict[str, str]] = {}
        self._probing: set[str] = set()
        self._gone_after = gone_after
        self._probe_failures = ProbeFailures(gone_after)
        # Acks not yet sent, by control subject (request id -> last DATA frame taken).
        self._acks = AckBatcher(nc, ack_interval, self._spawn)
        self._tasks: set[asyncio.Task[None]] = set()
        # The marker silence verdicts wait for (see _caught_up).
        self._marker: asyncio.Future[None] | None = None
        # Liveness probes before a silence verdict, one per instance at a time (see _still_running).
        self._liveness: dict[str, asyncio.Future[set[str] | None]] = {}
        self._marker_subject = ""
        self._marker_sent = 0.0
        self._markers_sent = 0
        #: Seconds a stream may wait for its worker's next output (0: for ever); see Inbox.
        self.progress_deadline = progress_deadline
        self._avoid: dict[str, float] = {}  # instance subject -> until when it gets no new request

    @property
    def connected(self) -> bool:
        return bool(self._nc.is_connected)

    def avoided(self, subject: str) -> bool:
        """Whether the instance behind ``subject`` should get no new request: its streams were cut because
        its connection is gone, or stalled because its engine is stuck, less than AVOID_S ago."""
        until = self._avoid.get(subject)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del self._avoid[subject]
        return False

    def _shun(self, subject: str) -> None:
        now = time.monotonic()
        # Expired entries go here (rarely), not only when asked about: a dead instance is never asked again.
        self._avoid = {avoided: until for avoided, until in self._avoid.items() if until > now}
        self._avoid[subject] = now + AVOID_S

    async def start(self) -> None:
        self._subscription = await self._nc.subscribe(self._prefix + ".*", cb=self._dispatch)
        try:
            await flush(self._nc)
        except TimeoutError:
            # A burst of requests on a cold ingress queues ahead of the PONG; the SUB went out before
            # any request will, and the server keeps a connection's order, so requests may go on.
            log.warning("NATS is slow to confirm this ingress's inbox subscription (over 10 s); going on")
        # Restarted if it dies (a bug): without it, no dead worker's streams would be cut.
        self._spawn(restarting(self._probe_forever, "request client probes"))

    async def close(self) -> None:
        self._acks.close()
        if self._marker is not None:
            self._marker.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._subscription is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._subscription.unsubscribe()

    async def _caught_up(self) -> bool:
        """Whether this client has taken in all that NATS had queued for it when asked.

        A marker message published to our own inbox queues up behind everything already on its way
        to us, and our subscription dispatches in order: once the marker is dispatched, so is all
        that came before it. One marker at a time is shared by all who ask. False when the marker
        takes longer than the silence timeout (we are far behind); True without a connection.
        (Not ``nc.flush()``: in nats-py 2.16 a flush that times out breaks the connection's reader.)
        """
        if not self._nc.is_connected:
            return True
        marker = self._marker
        if marker is None or marker.done() or time.monotonic() - self._marker_sent > self.silence_timeout:
            # The last one arrived, or was lost (a reconnection): send a new one.
            self._markers_sent += 1
            subject = f"{self._prefix}.m{self._markers_sent}"
            marker = self._marker = asyncio.get_running_loop().create_future()
            self._marker_subject, self._marker_sent = subject, time.monotonic()
            try:
                await self._nc.publish(subject, b"")
            except nats.errors.Error:
                return True
        try:
            await asyncio.wait_for(asyncio.shield(marker), self.silence_timeout)
        except TimeoutError:
            return not self._nc.is_connected
        return True

    async def _still_running(self, subject: str, request_id: str) -> bool | None:
        """Whether the worker behind ``subject`` answers that it runs ``request_id``; None if it does not answer.

        The worker gets LIVENESS_WAIT silence timeouts to answer: one whose event loop runs seconds
        behind (thousands of streams) answers late but answers; a hung one does not.

        One probe per instance at a time carries the ids of all its open streams; those who ask
        meanwhile share its answer.
        """
        probe = self._liveness.get(subject)
        if probe is None or probe.done():
            streams = self._open.get(subject, {})
            # A worker heard from lately on another stream is slow; one silent on all of them is hung.
            now = time.monotonic()
            heard = [inbox.last_heard for reply_to in streams if (inbox := self._inboxes.get(reply_to)) is not None]
            alive = any(now - last < self.silence_timeout for last in heard)
            wait = (LIVENESS_WAIT if alive else HUNG_WAIT) * self.silence_timeout
            probe = self._liveness[subject] = asyncio.ensure_future(
                self._unknown_to(subject, list(streams.values()), wait)
            )
        unknown = await asyncio.shield(probe)
        return None if unknown is None else request_id not in unknown

    async def _unknown_to(self, subject: str, request_ids: list[str], wait: float) -> set[str] | None:
        """Which of ``request_ids`` the worker says it does not run; None if it does not answer in ``wait`` s."""
        try:
            probe = encode(Probe(request_ids))
            answer = await self._nc.request(control_subject(subject), probe, wait)
            return set(unknown_decoder.decode(answer.data))
        except (TimeoutError, nats.errors.Error, msgspec.DecodeError):
            return None

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _dispatch(self, msg: Msg) -> None:
        inbox = self._inboxes.get(msg.subject)
        if inbox is not None:
            inbox.on_message(msg)
        elif msg.subject == self._marker_subject and self._marker is not None and not self._marker.done():
            self._marker.set_result(None)

    async def call(self, subject: str, request_id: str, payload: bytes) -> AsyncGenerator[list[msgspec.Raw], None]:
        """Send ``payload`` (one msgpack document) and yield the answer's payloads, a frame's worth at a time.

        Raises WorkerUnavailable before the first payload if no instance listens on ``subject`` (or
        it is shutting down; WorkerBusy if its queue is full), RequestTooLarge if the request is over
        a size limit, RemoteError if the worker reports an error, StreamBroken if the worker dies,
        goes silent, shuts down mid-stream, or frames are lost and not sent again within the silence
        timeout (StreamStalled if it sends no output within the progress deadline). Closing the iterator
        early tells the worker to stop.
        """
        if self._subscription is None:
            raise RuntimeError("RequestClient.start() was not awaited")
        nc = self._nc
        self._next += 1
        reply_to = f"{self._prefix}.{self._next}"
        inbox = self._inboxes[reply_to] = Inbox(
            self.silence_timeout,
            self._caught_up,
            lambda: self._still_running(subject, request_id),
            progress_deadline=self.progress_deadline,
            on_stall=lambda: self._stalled(subject),
        )
        open_streams = self._open.get(subject)
        if open_streams is None:
            open_streams = self._open[subject] = {}
        open_streams[reply_to] = request_id
        control = control_subject(subject)
        ack_every = self._ack_every
        acked = 0
        finished = False
        try:
            try:
                envelope = encode(Envelope(request_id, msgspec.Raw(payload), self.window))
                await nc.publish(subject, envelope, reply=reply_to)
            except nats.errors.MaxPayloadError as exc:
                finished = True
                raise RequestTooLarge(f"the request is over the NATS payload limit: {exc}") from exc
            expected = 1
            # While frames are missing: when to stop waiting for them, and the first frame past the gap.
            gap_until: float | None = None
            past_gap = 0
            queue = inbox.queue
            while True:
                if gap_until is None:
                    frame = await queue.get()
                else:
                    try:
                        async with asyncio.timeout_at(gap_until):
                            frame = await queue.get()
                    except TimeoutError:
                        raise StreamBroken(
                            f"frames lost on the stream from {subject} (got {past_gap}, wanted {expected}, and "
                            f"nothing sent again for {self.silence_timeout:g} s)",
                            cause="frames_lost",
                        ) from None
                if frame is None:
                    raise StreamBroken(f"{subject} went silent for {self.silence_timeout} s", cause="silent")
                if frame is NO_RESPONDERS:
                    finished = True
                    raise WorkerUnavailable(f"no instance listens on {subject}")
                if frame is NOT_TAKEN:
                    finished = True
                    raise WorkerUnavailable(f"{subject} never took the request (it says it does not run it)")
                if frame is STALLED:
                    raise StreamStalled(
                        f"{subject} sent no output for {self.progress_deadline:g} s (its engine makes no progress)"
                    )
                kind = frame.kind
                if kind == HEARTBEAT:
                    continue
                if kind == CUT:
                    finished = True
                    raise StreamBroken(frame.error, cause="cut")
                if frame.seq == -1:
                    finished = True
                    raise RemoteError(frame.error)
                if frame.seq != expected:
                    if frame.seq > expected and gap_until is None:
                        # Lost on the way (its worker's connection was reset): the worker sends every frame
                        # not acked again once it has reconnected. Those past the gap come again too.
                        gap_until = asyncio.get_running_loop().time() + self.silence_timeout
                        past_gap = frame.seq
                    continue  # past the gap, or sent again and taken already
                gap_until = None
                expected += 1
                if kind == DATA:
                    payloads = frame.payloads
                    if queue.qsize():
                        # Frames that came while this request's task waited its turn go on with this one: a
                        # reader that lags (a busy ingress) makes one pass down the pipeline for all of them
                        # (one detokenizing pass, one SSE event, one socket write) and catches up at a lower
                        # cost per token, as vLLM's output collector merges what its reader has not taken.
                        # A reader that keeps up takes the frames one by one, as they come.
                        expected, kind = take_following(queue, payloads, expected)
                    if kind == END:
                        finished = True
                        yield payloads
                        return
                    if expected - 1 - acked >= ack_every:
                        acked = expected - 1
                        self._acks.add(control, request_id, acked)
                        inbox.read()
                    yield payloads
                    continue
                finished = True
                if frame.payloads:
                    yield frame.payloads
                if kind == END:
                    return
                if frame.code == TOO_LARGE:
                    raise RequestTooLarge(frame.error)
                if frame.code == BUSY:
                    raise WorkerBusy(frame.error)
                if frame.code == UNAVAILABLE:
                    raise WorkerUnavailable(frame.error)
                if frame.code == REJECTED:
                    raise RequestRefused(frame.error)
                raise RemoteError(frame.error)
        finally:
            inbox.close()
            del self._inboxes[reply_to]
            del open_streams[reply_to]
            if not open_streams:
                del self._open[subject]
                self._liveness.pop(subject, None)
                self._probe_failures.clear(subject)
            if not finished:
                with contextlib.suppress(nats.errors.Error):
                    await nc.publish(control, encode(Stop(request_id)))

    async def _probe_forever(self) -> None:
        """Probe every instance with open streams, one probe per instance at a time."""
        while True:
            await asyncio.sleep(self.probe_interval)
            for subject in self._open:
                if subject not in self._probing:
                    self._probing.add(subject)
                    self._spawn(self._probe(subject))

    async def _probe(self, subject: str) -> None:
        """Probe ``subject`` until it answers, or until NATS has said nobody listens there for ``gone_after``.

        After a "no responders" the probes come four times per ``gone_after``, so that a worker that is
        gone has its streams cut soon after the span, and one whose connection blipped is cleared soon.
        """
        try:
            while subject in self._open:
                # The probe names the open streams: the worker keeps those of a slow reader past its ack
                # deadline, and stops any this client no longer reads (a Stop lost on the way).
                probe = encode(Probe(list(self._open[subject].values())))
                try:
                    await self._nc.request(control_subject(subject), probe, timeout=self._probe_timeout)
                except nats.errors.NoRespondersError:
                    if self._probe_failures.failed(subject, time.monotonic()):
                        self._probe_failures.clear(subject)
                        await self._cut(subject)
                        return
                    await asyncio.sleep(min(self.probe_interval, self._gone_after / 4))
                    continue
                except (TimeoutError, nats.errors.Error):
                    return  # no answer in time: a hung worker, which the silence timeout deals with
                self._probe_failures.clear(subject)
                return
        finally:
            self._probing.discard(subject)

    async def _cut(self, subject: str) -> None:
        """Break every open stream to ``subject``: its worker's connection is gone.

        The CUT frames travel through NATS to our own inbox rather than straight into the queues, so
        they arrive after every frame the worker sent before it died.
        """
        streams = list(self._open.get(subject, {}))
        self._shun(subject)
        log.warning(
            "instance %s is gone (nobody listens on its subject, its NATS connection closed): breaking %d stream(s)",
            subject,
            len(streams),
        )
        frame = encode(Frame(CUT, 0, error=f"the worker {subject} is gone (its NATS connection closed)"))
        for reply_to in streams:
            with contextlib.suppress(nats.errors.Error):
                await self._nc.publish(reply_to, frame)

    def _stalled(self, subject: str) -> None:
        """A stream to ``subject`` stalled: its engine is stuck. Its other streams that have waited as long
        (those waiting for their first output included) stall with it, and it gets no new request."""
        self._shun(subject)
        now = time.monotonic()
        stalled = 1
        for reply_to in self._open.get(subject, {}):
            inbox = self._inboxes.get(reply_to)
            if inbox is not None and not inbox.stalled and inbox.waited(now) >= self.progress_deadline:
                inbox.stall()
                stalled += 1
        log.warning(
            "instance %s sent no output for %g s (its engine is stuck?): %d stream(s) stalled, no new request for %g s",
            subject,
            self.progress_deadline,
            stalled,
            AVOID_S,
        )
