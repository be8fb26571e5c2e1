"""The worker's side of the request plane: requests in, their streams of frames out, with flow control."""

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from runtime.cluster.nats_connection import flush
from runtime.engine import RequestContext
from runtime.errors import FlotillaError, RequestRejected
from runtime.rate_limited_log import RateLimitedLog
from runtime.request_plane.flow import FRAME_OVERHEAD, batches, fitting
from runtime.request_plane.loop_bound import Wakeup
from runtime.request_plane.wire import (
    ABANDONED,
    BUSY,
    CUT,
    DATA,
    DEFAULT_ACK_DEADLINE,
    DEFAULT_MAX_REQUEST_BYTES,
    END,
    ERROR,
    HEARTBEAT,
    REJECTED,
    TOO_LARGE,
    UNAVAILABLE,
    UNLIMITED,
    Acks,
    Envelope,
    Frame,
    Handler,
    Probe,
    control_decoder,
    control_subject,
    encode,
    envelope_decoder,
)
from runtime.supervision import restarting

log = logging.getLogger(__name__)

_MAX_ERROR_CHARS = 4000
#: The longest stop_taking_requests waits for the requests NATS delivered before the unsubscription to be
#: refused (a round trip to the server, then a callback each): past it, those left are dropped.
SUBSCRIPTION_DRAIN_S = 5.0


class _Stream:
    """Server-side state of one request being answered."""

    __slots__ = (
        "acked",
        "closed",
        "context",
        "failure",
        "finished",
        "heard",
        "last_sent",
        "pending",
        "pending_bytes",
        "queued",
        "reply_to",
        "request_id",
        "room",
        "sent",
        "seq",
        "task",
        "window",
    )

    def __init__(self, request_id: str, reply_to: str, window: int) -> None:
        self.request_id = request_id
        self.context = RequestContext(request_id)
        self.reply_to = reply_to
        self.window = window
        self.seq = 0  # the last frame sent
        self.acked = 0  # the last DATA frame the client took
        # The frames sent and not acked yet, (seq, encoded): sent again after a reconnection (see _resend).
        self.sent: deque[tuple[int, bytes]] = deque()
        self.last_sent = time.monotonic()
        # When the client last showed that it reads this stream (an ack, a probe naming it; it starts as the
        # stream's start): a full window with no news for the ack deadline means the client is gone.
        self.heard = self.last_sent
        self.task: asyncio.Task[None] | None = None
        self.pending: list[msgspec.Raw] = []  # outputs not sent yet
        self.pending_bytes = 0
        # Set while the handler waits for the pending outputs to leave (they are a frame's worth).
        self.room: asyncio.Future[None] | None = None
        self.finished = False  # the handler is done: the last frame (END or ERROR) is due
        self.failure: Exception | None = None  # why the handler failed, if it did
        self.queued = False  # waiting in the server's send queue
        self.closed = False  # the last frame went (or the request was stopped): nothing more is sent

    @property
    def window_full(self) -> bool:
        return self.seq - self.acked >= self.window


class EndpointServer:
    """Serves one instance subject with ``handler``; ``drain()`` then ``close()`` shut it down.

    Each request runs its handler in a task of its own, which leaves what it yields in the request's
    stream; one sender task publishes the frames of every stream that has something to send. When an
    engine step hands new tokens to many requests at once, their frames then leave in one pass of the
    sender, rather than each request waking a writer of its own (one task switch less per token). A
    handler's last output and its end are seen together, so the last payloads travel in the END frame.

    Outputs that wait for the window are bounded: once they fill a frame (the connection's
    ``max_payload``), the handler is not asked for more until they leave; and no frame is larger than
    ``max_payload``, the last one included (its outputs go in DATA frames before it when need be).

    A stream whose window is full and whose client has sent no word (no ack, no probe naming it) for
    ``ack_deadline`` s is stopped and its engine request aborted, at most ``ack_deadline`` s after the
    client's last word: its client is gone (killed, cut off, or its Stop was lost), and the engine would
    otherwise generate to ``max_tokens`` for nobody. A client that is there but reads slowly names its
    streams in its probes (every 0.4 s), so it keeps them.

    A connection that is reset loses the frames on their way in it. Each stream keeps the frames its
    client has not acked (at most a window's worth, and the last one), and once the connection is back
    they are all sent again; the client skips those it has. A stream that ended keeps them for
    ``ack_deadline`` s, its last frame may have been lost too.

    With ``max_waiting``, a request that finds ``waiting()`` requests already waiting for the engine
    (default: every request in flight here) is refused at once as busy, so that its client tries
    another instance: a worker's own queue is bounded whatever its clients believe.
    """

    def __init__(
        self,
        nc: NATS,
        subject: str,
        handler: Handler,
        *,
        heartbeat_interval: float = 1.0,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        ack_deadline: float = DEFAULT_ACK_DEADLINE,
        max_waiting: int = 0,
        waiting: Callable[[], int] | None = None,
    ) -> None:
        self._nc = nc
        self.subject = subject
        self._handler = handler
        self._heartbeat_interval = heartbeat_interval
        self._max_request_bytes = max_request_bytes
        self._ack_deadline = ack_deadline
        self._limit = DEFAULT_MAX_REQUEST_BYTES - FRAME_OVERHEAD  # see _frame_limit()
        self._streams: dict[str, _Stream] = {}
        self._requests: Subscription | None = None
        self._control: Subscription | None = None
        self._heartbeats: asyncio.Task[None] | None = None
        self._sender: asyncio.Task[None] | None = None
        # Streams with a frame to send, in the order they got it; the sender waits on the wake-up.
        self._due: list[_Stream] = []
        self._due_wake: Wakeup | None = None
        self._draining = False
        self._max_waiting = max_waiting
        self._waiting = waiting or (lambda: len(self._streams))
        # DATA and END frames sent on every stream: heartbeats carry it (see Frame.progress).
        self._frames_sent = 0
        # Streams whose last frame went less than an ack deadline ago (when, stream), oldest first: a
        # reconnection sends their unacked frames again too.
        self._ended: deque[tuple[float, _Stream]] = deque()
        self._reconnects = 0  # the connection's reconnections seen so far
        # Held by a pass of the sender, and by _resend: a frame sent meanwhile would land among the frames
        # sent again, and the client, which skips frames past a gap, would never see it.
        self._sending = asyncio.Lock()
        # Refusals are many when a worker is busy: one line per 10 s says so, with how many.
        self._busy_log = RateLimitedLog(log, period_s=10.0)
        #: Streams stopped because their client stopped acking past the ack deadline (for metrics).
        self.abandoned = 0

    @property
    def active_requests(self) -> int:
        return len(self._streams)

    @property
    def refused_busy(self) -> int:
        """Requests refused because the queue was full."""
        return self._busy_log.count

    async def start(self) -> None:
        self._frame_limit()
        self._due_wake = Wakeup()
        self._reconnects = self._nc.stats["reconnects"]
        # Both loops are restarted if they die (a bug): a worker without them looks frozen to its clients.
        sender = f"sender {self.subject}"
        self._sender = asyncio.create_task(restarting(self._send_forever, sender), name=sender)
        self._requests = await self._nc.subscribe(self.subject, cb=self._on_request)
        self._control = await self._nc.subscribe(control_subject(self.subject), cb=self._on_control)
        # Make sure the server has the subscriptions before anyone is told this instance exists.
        await flush(self._nc)
        name = f"heartbeats {self.subject}"
        self._heartbeats = asyncio.create_task(restarting(self._heartbeat_loop, name), name=name)

    async def stop_taking_requests(self) -> None:
        """Refuse new requests from now on; streams in flight, stops, acks and probes go on."""
        self._draining = True
        requests, self._requests = self._requests, None
        if requests is not None:
            # From now on NATS answers "no responders", and clients try another instance at once. Drained,
            # not unsubscribed: unsubscribing drops the requests the server delivered before it heard of it,
            # unanswered (their clients would wait a silence timeout to learn it). Drained, each of them is
            # refused (UNAVAILABLE: _on_request), and its client tries another instance at once.
            try:
                async with asyncio.timeout(SUBSCRIPTION_DRAIN_S):
                    await requests.drain()  # type: ignore[no-untyped-call]
            except (nats.errors.Error, TimeoutError):
                with contextlib.suppress(nats.errors.Error):
                    await requests.unsubscribe()

    async def drain(self, grace: float) -> int:
        """Stop taking requests, give those in flight up to ``grace`` s to finish, then cut the rest.

        A cut stream gets a CUT frame, on which its client gives up on this worker at once (and
        migrates the request). Returns the number of streams cut.
        """
        await self.stop_taking_requests()
        running = [stream.task for stream in self._streams.values() if stream.task is not None]
        if running:
            log.info("draining %s: %d request(s) in flight, up to %g s", self.subject, len(running), grace)
            await asyncio.wait(running, timeout=grace)
            async with self._sending:
                await self._send_due()  # the last frames of those that finished
        cut = list(self._streams.values())
        if not cut:
            return 0
        await self._stop_streams()
        for stream in cut:
            frame = Frame(CUT, stream.seq + 1, error=f"the worker {self.subject} shut down")
            with contextlib.suppress(nats.errors.Error):
                await self._nc.publish(stream.reply_to, encode(frame))
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await flush(self._nc)
        log.warning("cut %d request(s) still running on %s after the %g s drain", len(cut), self.subject, grace)
        return len(cut)

    async def close(self) -> None:
        """Stop taking requests and stop the ones running (call ``drain`` first to let them finish)."""
        await self.stop_taking_requests()
        if self._control is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._control.unsubscribe()
            self._control = None
        if self._heartbeats is not None:
            self._heartbeats.cancel()
        await self._stop_streams()
        if self._sender is not None:
            self._sender.cancel()
            await asyncio.gather(self._sender, return_exceptions=True)
            self._sender = None

    async def _stop_streams(self) -> None:
        streams = list(self._streams.values())
        for stream in streams:
            self._stop(stream)
        await asyncio.gather(*(stream.task for stream in streams if stream.task is not None), return_exceptions=True)

    def _forget(self, stream: _Stream) -> None:
        """Send nothing more on ``stream``: its last frame went, or it was stopped."""
        stream.closed = True
        self._streams.pop(stream.request_id, None)

    def _stop(self, stream: _Stream) -> None:
        """Stop ``stream``'s engine work and its task, and send nothing more on it."""
        self._forget(stream)
        stream.context.stop()
        if stream.task is not None:
            stream.task.cancel()

    async def _on_request(self, msg: Msg) -> None:
        if not msg.reply:
            log.warning("dropped a request without a reply subject on %s", self.subject)
            return
        if self._draining:
            # Delivered just before the unsubscribe took effect: send the client elsewhere.
            await self._refuse(msg.reply, f"{self.subject} is shutting down", UNAVAILABLE)
            return
        if self._max_waiting and (waiting := self._waiting()) >= self._max_waiting:
            reason = (
                f"{self.subject} is busy: {waiting} request(s) wait for its engine (the limit is {self._max_waiting})"
            )
            self._busy_log.warning(f"refused a request: {reason}")
            await self._refuse(msg.reply, reason, BUSY)
            return
        if len(msg.data) > self._max_request_bytes:
            size, limit = len(msg.data), self._max_request_bytes
            log.warning("rejected a %d-byte request on %s (limit %d)", size, self.subject, limit)
            await self._refuse(msg.reply, f"request of {size} bytes is over the limit of {limit}", TOO_LARGE)
            return
        try:
            envelope = envelope_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("rejected a malformed request on %s: %s", self.subject, exc)
            await self._refuse(msg.reply, f"malformed request envelope: {exc}")
            return
        if envelope.request_id in self._streams:
            await self._refuse(msg.reply, f"request id {envelope.request_id!r} is already running here")
            return
        stream = _Stream(envelope.request_id, msg.reply, envelope.window or UNLIMITED)
        self._streams[envelope.request_id] = stream
        stream.task = asyncio.create_task(self._produce(envelope, stream), name=f"request {envelope.request_id}")

    async def _refuse(self, reply_to: str, reason: str, code: str = "") -> None:
        with contextlib.suppress(nats.errors.Error):
            await self._nc.publish(reply_to, encode(Frame(ERROR, 1, error=reason, code=code)))

    async def _on_control(self, msg: Msg) -> None:
        try:
            control = control_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("ignored a malformed control message on %s: %s", self.subject, exc)
            return
        if isinstance(control, Acks):
            streams = self._streams
            now = time.monotonic()
            for request_id, seq in control.acks:
                stream = streams.get(request_id)
                if stream is not None and seq > stream.acked:
                    stream.acked = seq
                    stream.heard = now
                    sent = stream.sent
                    while sent and sent[0][0] <= seq:
                        sent.popleft()
                    if stream.pending and not stream.queued and not stream.window_full:
                        self._queue(stream)  # the window reopened on outputs that waited
        elif isinstance(control, Probe):
            streams = self._streams
            now = time.monotonic()
            unknown = []
            for request_id in control.request_ids:
                stream = streams.get(request_id)
                if stream is None:
                    unknown.append(request_id)
                else:
                    stream.heard = now  # its client is there and still wants it
            if msg.reply:
                with contextlib.suppress(nats.errors.Error):
                    await self._nc.publish(msg.reply, encode(unknown))
        else:
            stream = self._streams.get(control.request_id)
            if stream is not None:
                log.debug("request %s stopped by its client", control.request_id)
                self._stop(stream)

    async def _produce(self, envelope: Envelope, stream: _Stream) -> None:
        """Run the handler, leaving what it yields in ``stream`` for the sender.

        Outputs wait there while the stream's window is full, and leave later as one frame; once they
        fill a frame, the handler waits for them to leave.
        """
        outputs = self._handler(envelope.payload, stream.context)
        try:
            async for payload in outputs:
                stream.pending.append(msgspec.Raw(payload))
                stream.pending_bytes += len(payload)
                if not stream.queued and not stream.window_full:
                    self._queue(stream)
                if stream.pending_bytes >= self._limit:
                    stream.room = asyncio.get_running_loop().create_future()
                    await stream.room
        except asyncio.CancelledError:
            self._forget(stream)  # stopped by the client, its ack deadline, or drain() / close()
            return
        except Exception as exc:
            stream.failure = exc
        finally:
            if isinstance(outputs, AsyncGenerator):
                # Stopped between two outputs, the handler (and the engine request under it) is closed
                # here and now, not whenever the garbage collector finds it.
                with contextlib.suppress(Exception):
                    await outputs.aclose()
        stream.finished = True
        if not stream.queued:
            self._queue(stream)

    def _frame_limit(self) -> int:
        """The most payload bytes one DATA or END frame may carry on this connection (a server of another
        ``max_payload`` after a reconnection changes it)."""
        self._limit = max(1, self._nc.max_payload - FRAME_OVERHEAD)
        return self._limit

    def _queue(self, stream: _Stream) -> None:
        stream.queued = True
        self._due.append(stream)
        if self._due_wake is not None:
            self._due_wake.set()

    async def _send_forever(self) -> None:
        """Publish the frames of the streams that have some, as they come. Never fails: a stream whose
        frame cannot be published is stopped, and a bug is logged and the sending goes on."""
        wake = self._due_wake
        assert wake is not None
        while True:
            await wake.wait()
            wake.clear()
            try:
                async with self._sending:
                    await self._send_due()
            except Exception:
                log.exception("the sender of %s failed on a batch of frames; it goes on", self.subject)

    async def _send_due(self) -> None:
        """One frame for each stream due: a DATA frame of its pending outputs (window allowing, at most a
        frame's worth; the rest waits for the next pass), or, once its handler is done, the last frame,
        window or not (it ends the stream; outputs that do not fit in it go in DATA frames before it)."""
        due, self._due = self._due, []
        self._frames_sent += len(due)  # near enough: it tells a stuck engine from a working one
        publish = self._nc.publish
        limit = self._frame_limit()
        for stream in due:
            stream.queued = False
            if stream.closed:
                continue
            pending = stream.pending
            try:
                if stream.finished:
                    self._forget(stream)
                    exc = stream.failure
                    # Bounded, so that the ERROR frame itself fits.
                    error = "" if exc is None else str(exc)[:_MAX_ERROR_CHARS]
                    room_left = limit - len(error.encode())
                    *before, last = [pending] if stream.pending_bytes <= room_left else batches(pending, room_left)
                    for batch in before:
                        stream.seq += 1
                        await self._publish(stream, Frame(DATA, stream.seq, batch))
                    stream.seq += 1
                    if exc is not None:
                        log.warning(
                            "request %s failed: %s", stream.request_id, exc, exc_info=not isinstance(exc, FlotillaError)
                        )
                        # A refusal of the client's request is coded, so that its ingress answers 400.
                        code = REJECTED if isinstance(exc, RequestRejected) else ""
                        await self._publish(stream, Frame(ERROR, stream.seq, last, error, code))
                    else:
                        await self._publish(stream, Frame(END, stream.seq, last))
                    self._ended.append((time.monotonic(), stream))
                elif pending and not stream.window_full:
                    if stream.pending_bytes <= limit:
                        batch, stream.pending, stream.pending_bytes = pending, [], 0
                    else:
                        count, size = fitting(pending, limit)
                        batch, stream.pending = pending[:count], pending[count:]
                        stream.pending_bytes -= size
                    stream.seq += 1
                    stream.last_sent = time.monotonic()
                    if stream.pending and not stream.window_full:
                        self._queue(stream)  # more than a frame's worth waited: the rest goes next pass
                    room = stream.room
                    if room is not None and stream.pending_bytes < limit:
                        stream.room = None
                        room.set_result(None)  # the handler may go on
                    await self._publish(stream, Frame(DATA, stream.seq, batch))
            except nats.errors.MaxPayloadError:
                # One output alone is over the limit: say so, rather than leave the client to a silence.
                size = max((len(payload) for payload in pending), default=0)
                error = f"an output of {size} bytes is over the NATS payload limit of {self._nc.max_payload}"
                log.warning("request %s: %s", stream.request_id, error)
                self._stop(stream)
                with contextlib.suppress(nats.errors.Error):
                    await publish(stream.reply_to, encode(Frame(ERROR, stream.seq, error=error)))
            except nats.errors.Error as exc:
                log.warning("request %s: cannot publish its answer: %s", stream.request_id, exc)
                self._stop(stream)

    async def _publish(self, stream: _Stream, frame: Frame) -> None:
        """Publish a numbered frame of ``stream``, kept until its client acks it (a client that acks
        nothing, with no window, gets nothing sent again)."""
        data = encode(frame)
        if stream.window != UNLIMITED:
            stream.sent.append((frame.seq, data))
        await self._nc.publish(stream.reply_to, data)

    async def _resend(self) -> None:
        """Send again the frames not acked of every stream open or lately ended: the connection was reset,
        and what was on its way in it is lost (their clients skip the frames they have)."""
        streams = [*self._streams.values(), *(stream for _, stream in self._ended)]
        frames = 0
        async with self._sending:
            for stream in streams:
                for _, data in list(stream.sent):  # acks may come meanwhile
                    with contextlib.suppress(nats.errors.Error):
                        await self._nc.publish(stream.reply_to, data)
                    frames += 1
        if frames:
            log.info("reconnected to NATS: sent %d frame(s) of %d stream(s) again", frames, len(streams))

    async def _heartbeat_loop(self) -> None:
        """Publish a heartbeat on every stream that has been quiet for an interval (a full window too),
        stop the streams whose client is gone (see ``_abandon``), and after a reconnection send the frames
        not acked again (see ``_resend``)."""
        interval = self._heartbeat_interval
        deadline = self._ack_deadline
        while True:
            # Heartbeats at most a quarter of an interval late. A stream is abandoned at the first look past
            # ``deadline - period`` without word, so never later than ``deadline``: a live client names its
            # streams in a probe every 0.4 s, so a silence that long is a client gone.
            period = min(interval, deadline) / 4
            await asyncio.sleep(period)
            reconnects = self._nc.stats["reconnects"]
            if reconnects != self._reconnects:
                self._reconnects = reconnects
                await self._resend()
            now = time.monotonic()
            ended = self._ended
            while ended and now - ended[0][0] > deadline:
                ended.popleft()
            abandoned = []
            for stream in list(self._streams.values()):
                if stream.window_full and now - stream.heard > deadline - period:
                    abandoned.append(stream)
                elif now - stream.last_sent >= interval:
                    stream.last_sent = now
                    with contextlib.suppress(nats.errors.Error):
                        heartbeat = Frame(HEARTBEAT, stream.seq, progress=self._frames_sent)
                        await self._nc.publish(stream.reply_to, encode(heartbeat))
            if abandoned:
                await self._abandon(abandoned)

    async def _abandon(self, streams: list[_Stream]) -> None:
        """Stop ``streams``, whose window stayed full with no word from their client past the ack deadline.

        Each gets an ERROR frame, in case its client is there after all (an event loop stalled for
        seconds): it fails the request rather than wait for a silence and migrate it.
        """
        deadline = self._ack_deadline
        self.abandoned += len(streams)
        for stream in streams:
            self._stop(stream)
            frame = Frame(ERROR, stream.seq + 1, error=f"no ack from the client for {deadline:g} s", code=ABANDONED)
            with contextlib.suppress(nats.errors.Error):
                await self._nc.publish(stream.reply_to, encode(frame))
        # One line for them all: an ingress killed with thousands of streams in flight is one event.
        log.warning(
            "stopped %d stream(s) on %s whose client sent no ack for %g s (gone?), e.g. request %s",
            len(streams),
            self.subject,
            deadline,
            streams[0].request_id,
        )
