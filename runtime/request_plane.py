"""The request plane: one request to one chosen instance over NATS, its response streamed back.

Protocol (all messages msgpack):

* The client publishes ``Envelope(request_id, payload, window)`` to the instance's subject, with a
  reply subject on its own inbox. If nobody listens there, NATS itself answers "no responders" on that
  reply subject, so a dead or missing instance is known before anything is generated.
* The worker publishes ``Frame(kind, seq, payloads)`` to the reply subject: ``DATA`` frames in
  order, then ``END`` (which may carry the last payloads) or ``ERROR``. Payloads produced back to back
  travel in one frame, so a fast engine costs few messages; and frames that wait in the client's queue
  for its reader are taken as one, so a lagging reader catches up at a lower cost per token. While it
  has nothing to send the worker publishes ``HEARTBEAT`` frames, so a client that hears nothing for
  ``silence_timeout`` knows the worker is gone (or hung) and does not wait forever. Before it says
  so, the client makes sure the silence is not its own: it first catches up on what NATS holds for it
  (a marker through its own inbox), then asks the worker (a ``Probe`` listing its open requests)
  whether it still runs the request; an overloaded worker that answers yes is slow, not gone, and is waited for.
* Flow control: a worker keeps at most ``window`` DATA frames of a stream unacknowledged. While the
  window is full its outputs pile up on the worker and leave later as one bigger frame, so a slow
  reader slows its writers instead of being cut off by nats-server as a slow consumer. The client
  acknowledges frames as its consumer takes them, every ``window // 4`` frames, and sends the acks of
  all its streams to one instance as one ``Acks`` message per short tick.
* Death detection: while streams to an instance are open, the client probes that instance's control
  subject (a ``Probe`` request) every ``probe_interval``. NATS answers "no responders" at once when the
  worker's connection is gone (a killed process's socket closes), and the client then cuts every
  stream to that instance (StreamBroken) without waiting out the silence timeout, which stays the
  fallback for a worker that hangs with its connection open.
* Drain: a worker that shuts down stops taking requests, lets those in flight finish for a grace
  period, then sends each stream still running a ``CUT`` frame, which its client treats as a broken
  stream at once (and migrates).
* The client stops a request by publishing ``Stop(request_id)`` to ``<subject>.control``.

Payloads are msgpack documents (the engines' wire types, runtime/protocol.py) embedded as they are
(``msgspec.Raw``): encoded once by whoever made them, never wrapped as bytes inside bytes.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from runtime.engine import RequestContext
from runtime.errors import FlotillaError
from runtime.loop_bound import SingleReaderQueue, Wakeup
from runtime.nats_connection import flush

log = logging.getLogger(__name__)

DATA, END, ERROR, HEARTBEAT, CUT = range(5)
DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # NATS's own default max_payload
DEFAULT_WINDOW = 16
_UNLIMITED = 1 << 62

# Frame.code values: why a worker refused a request.
TOO_LARGE = "too_large"
UNAVAILABLE = "unavailable"


class RequestPlaneError(FlotillaError):
    """A request could not be delivered or its stream broke."""


class WorkerUnavailable(RequestPlaneError):
    """No instance listens on the subject, or it is shutting down; nothing was generated."""


class StreamBroken(RequestPlaneError):
    """The stream stopped mid-way: the worker died, went silent, was shut down, or frames were lost."""


class RemoteError(RequestPlaneError):
    """The worker reported an error for this request."""


class RequestTooLarge(RemoteError):
    """The request is over the worker's (or NATS's) size limit; nothing was generated."""


class Envelope(msgspec.Struct, array_like=True):
    request_id: str
    payload: msgspec.Raw
    #: DATA frames the worker may send ahead of the client's acks (0: no limit).
    window: int = 0


class Frame(msgspec.Struct, array_like=True):
    kind: int
    seq: int
    payloads: list[msgspec.Raw] = msgspec.field(default_factory=list)
    error: str = ""
    code: str = ""


class Stop(msgspec.Struct, array_like=True, tag=0):
    """Stop generating for this request: its client is gone."""

    request_id: str


class Acks(msgspec.Struct, array_like=True, tag=1):
    """Cumulative acknowledgements: (request id, last DATA frame taken) for streams to one instance."""

    acks: list[tuple[str, int]]


class Probe(msgspec.Struct, array_like=True, tag=2):
    """Are you there? The worker answers with the msgpack list of those ``request_ids`` it does not know."""

    request_ids: list[str] = msgspec.field(default_factory=list)


_encode = msgspec.msgpack.encode
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_frame_decoder = msgspec.msgpack.Decoder(Frame)
_control_decoder = msgspec.msgpack.Decoder(Stop | Acks | Probe)
_PROBE = _encode(Probe())
_unknown_decoder = msgspec.msgpack.Decoder(list[str])

#: A bytes-level request handler: the request's msgpack document in, encoded msgpack documents out.
Handler = Callable[[msgspec.Raw, RequestContext], AsyncIterator[bytes]]


def control_subject(subject: str) -> str:
    return subject + ".control"


class _Stream:
    """Server-side state of one request being answered."""

    __slots__ = (
        "acked",
        "closed",
        "context",
        "failure",
        "finished",
        "last_sent",
        "pending",
        "queued",
        "reply_to",
        "request_id",
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
        self.last_sent = time.monotonic()
        self.task: asyncio.Task[None] | None = None
        self.pending: list[msgspec.Raw] = []  # outputs not sent yet
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
    """

    def __init__(
        self,
        nc: NATS,
        subject: str,
        handler: Handler,
        *,
        heartbeat_interval: float = 1.0,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        self._nc = nc
        self.subject = subject
        self._handler = handler
        self._heartbeat_interval = heartbeat_interval
        self._max_request_bytes = max_request_bytes
        self._streams: dict[str, _Stream] = {}
        self._requests: Subscription | None = None
        self._control: Subscription | None = None
        self._heartbeats: asyncio.Task[None] | None = None
        self._sender: asyncio.Task[None] | None = None
        # Streams with a frame to send, in the order they got it; the sender waits on the wake-up.
        self._due: list[_Stream] = []
        self._due_wake: Wakeup | None = None
        self._draining = False

    @property
    def active_requests(self) -> int:
        return len(self._streams)

    async def start(self) -> None:
        self._due_wake = Wakeup()
        self._sender = asyncio.create_task(self._send_forever(), name=f"sender {self.subject}")
        self._requests = await self._nc.subscribe(self.subject, cb=self._on_request)
        self._control = await self._nc.subscribe(control_subject(self.subject), cb=self._on_control)
        # Make sure the server has the subscriptions before anyone is told this instance exists.
        await flush(self._nc)
        self._heartbeats = asyncio.create_task(self._heartbeat_loop(), name=f"heartbeats {self.subject}")

    async def stop_taking_requests(self) -> None:
        """Refuse new requests from now on; streams in flight, stops, acks and probes go on."""
        self._draining = True
        if self._requests is not None:
            # From now on NATS answers "no responders", and clients try another instance at once.
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await self._requests.unsubscribe()
                await flush(self._nc)
            self._requests = None

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
            await self._send_due()  # the last frames of those that finished
        cut = list(self._streams.values())
        if not cut:
            return 0
        await self._stop_streams()
        for stream in cut:
            frame = Frame(CUT, stream.seq + 1, error=f"the worker {self.subject} shut down")
            with contextlib.suppress(nats.errors.Error):
                await self._nc.publish(stream.reply_to, _encode(frame))
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
        if len(msg.data) > self._max_request_bytes:
            size, limit = len(msg.data), self._max_request_bytes
            log.warning("rejected a %d-byte request on %s (limit %d)", size, self.subject, limit)
            await self._refuse(msg.reply, f"request of {size} bytes is over the limit of {limit}", TOO_LARGE)
            return
        try:
            envelope = _envelope_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("rejected a malformed request on %s: %s", self.subject, exc)
            await self._refuse(msg.reply, f"malformed request envelope: {exc}")
            return
        if envelope.request_id in self._streams:
            await self._refuse(msg.reply, f"request id {envelope.request_id!r} is already running here")
            return
        stream = _Stream(envelope.request_id, msg.reply, envelope.window or _UNLIMITED)
        self._streams[envelope.request_id] = stream
        stream.task = asyncio.create_task(self._produce(envelope, stream), name=f"request {envelope.request_id}")

    async def _refuse(self, reply_to: str, reason: str, code: str = "") -> None:
        with contextlib.suppress(nats.errors.Error):
            await self._nc.publish(reply_to, _encode(Frame(ERROR, 1, error=reason, code=code)))

    async def _on_control(self, msg: Msg) -> None:
        try:
            control = _control_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("ignored a malformed control message on %s: %s", self.subject, exc)
            return
        if isinstance(control, Acks):
            streams = self._streams
            for request_id, seq in control.acks:
                stream = streams.get(request_id)
                if stream is not None and seq > stream.acked:
                    stream.acked = seq
                    if stream.pending and not stream.queued and not stream.window_full:
                        self._queue(stream)  # the window reopened on outputs that waited
        elif isinstance(control, Probe):
            if msg.reply:
                unknown = [request_id for request_id in control.request_ids if request_id not in self._streams]
                with contextlib.suppress(nats.errors.Error):
                    await self._nc.publish(msg.reply, _encode(unknown))
        else:
            stream = self._streams.get(control.request_id)
            if stream is not None:
                log.debug("request %s stopped by its client", control.request_id)
                self._stop(stream)

    async def _produce(self, envelope: Envelope, stream: _Stream) -> None:
        """Run the handler, leaving what it yields in ``stream`` for the sender.

        Outputs wait there while the stream's window is full, and leave later as one frame.
        """
        try:
            async for payload in self._handler(envelope.payload, stream.context):
                stream.pending.append(msgspec.Raw(payload))
                if not stream.queued and not stream.window_full:
                    self._queue(stream)
        except asyncio.CancelledError:
            self._forget(stream)  # stopped by the client, or by drain() / close()
            return
        except Exception as exc:
            stream.failure = exc
        stream.finished = True
        if not stream.queued:
            self._queue(stream)

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
                await self._send_due()
            except Exception:
                log.exception("the sender of %s failed on a batch of frames; it goes on", self.subject)

    async def _send_due(self) -> None:
        """One frame for each stream due: a DATA frame of its pending outputs (window allowing), or,
        once its handler is done, the last frame, window or not (one message, and it ends the stream)."""
        due, self._due = self._due, []
        publish = self._nc.publish
        for stream in due:
            stream.queued = False
            if stream.closed:
                continue
            batch = stream.pending
            try:
                if stream.finished:
                    self._forget(stream)
                    stream.seq += 1
                    if (exc := stream.failure) is not None:
                        log.warning(
                            "request %s failed: %s", stream.request_id, exc, exc_info=not isinstance(exc, FlotillaError)
                        )
                        await publish(stream.reply_to, _encode(Frame(ERROR, stream.seq, batch, str(exc))))
                    else:
                        await publish(stream.reply_to, _encode(Frame(END, stream.seq, batch)))
                elif batch and not stream.window_full:
                    stream.pending = []
                    stream.seq += 1
                    stream.last_sent = time.monotonic()
                    await publish(stream.reply_to, _encode(Frame(DATA, stream.seq, batch)))
            except nats.errors.Error as exc:
                log.warning("request %s: cannot publish its answer: %s", stream.request_id, exc)
                self._stop(stream)

    async def _heartbeat_loop(self) -> None:
        """Publish a heartbeat on every stream that has been quiet for an interval (a full window too)."""
        interval = self._heartbeat_interval
        while True:
            await asyncio.sleep(interval / 2)
            now = time.monotonic()
            for stream in list(self._streams.values()):
                if now - stream.last_sent >= interval:
                    stream.last_sent = now
                    with contextlib.suppress(nats.errors.Error):
                        await self._nc.publish(stream.reply_to, _encode(Frame(HEARTBEAT, stream.seq)))


# What NATS's "no responders" status message becomes in an inbox's queue.
NO_RESPONDERS = Frame(ERROR, 0, error="no responders")


class _Inbox:
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
            self.queue.put_nowait(_frame_decoder.decode(msg.data))
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


def _take_following(
    queue: SingleReaderQueue[Frame | None], payloads: list[msgspec.Raw], expected: int
) -> tuple[int, int]:
    """Move onto ``payloads`` the payloads of the DATA frames next in sequence at the head of ``queue``, and
    of an END frame after them.

    Returns the sequence number expected next and the kind of the last frame taken (DATA or END).
    Anything else at the head (a heartbeat, an error, a frame out of sequence) stays for the caller.
    """
    kind = DATA
    while queue.qsize():
        frame = queue.first()
        if frame is None or frame.seq != expected or frame.kind not in (DATA, END):
            break
        queue.get_nowait()
        payloads += frame.payloads
        expected += 1
        kind = frame.kind
        if kind == END:
            break
    return expected, kind


# How many silence timeouts a worker is given to answer the probe that confirms a silence.
LIVENESS_WAIT = 6

# How late a silence timer may fire before the client counts itself as behind (see _Inbox).
_LOOP_LAG_TOLERANCE = 0.5


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
    ) -> None:
        self._nc = nc
        self.silence_timeout = silence_timeout
        self.window = max(1, window)
        self._ack_every = max(1, self.window // 4)
        self._ack_interval = ack_interval
        self.probe_interval = probe_interval
        # Short, so that a probe the worker took just before dying does not hold up the next one long.
        self._probe_timeout = min(silence_timeout, max(1.0, 2 * probe_interval))
        self._prefix = nc.new_inbox()
        self._inboxes: dict[str, _Inbox] = {}
        self._subscription: Subscription | None = None
        self._next = 0
        # Open streams by instance subject (reply subject -> request id): what the probes watch.
        self._open: dict[str, dict[str, str]] = {}
        self._probing: set[str] = set()
        # Acks not yet sent, by control subject (request id -> last DATA frame taken).
        self._acks: dict[str, dict[str, int]] = {}
        self._ack_flush: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # The marker silence verdicts wait for (see _caught_up).
        self._marker: asyncio.Future[None] | None = None
        # Liveness probes before a silence verdict, one per instance at a time (see _still_running).
        self._liveness: dict[str, asyncio.Future[set[str] | None]] = {}
        self._marker_subject = ""
        self._marker_sent = 0.0
        self._markers_sent = 0

    @property
    def connected(self) -> bool:
        return bool(self._nc.is_connected)

    async def start(self) -> None:
        self._subscription = await self._nc.subscribe(self._prefix + ".*", cb=self._dispatch)
        try:
            await flush(self._nc)
        except TimeoutError:
            # A burst of requests on a cold ingress queues ahead of the PONG; the SUB went out before
            # any request will, and the server keeps a connection's order, so requests may go on.
            log.warning("NATS is slow to confirm this ingress's inbox subscription (over 10 s); going on")
        self._spawn(self._probe_forever())

    async def close(self) -> None:
        if self._ack_flush is not None:
            self._ack_flush.cancel()
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

    async def _still_running(self, subject: str, request_id: str) -> bool:
        """Whether the worker behind ``subject`` answers that it runs ``request_id``.

        The worker gets LIVENESS_WAIT silence timeouts to answer: one whose event loop runs seconds
        behind (thousands of streams) answers late but answers; a hung one does not.

        One probe per instance at a time carries the ids of all its open streams; those who ask
        meanwhile share its answer.
        """
        probe = self._liveness.get(subject)
        if probe is None or probe.done():
            request_ids = list(self._open.get(subject, {}).values())
            probe = self._liveness[subject] = asyncio.ensure_future(self._unknown_to(subject, request_ids))
        unknown = await asyncio.shield(probe)
        return unknown is not None and request_id not in unknown

    async def _unknown_to(self, subject: str, request_ids: list[str]) -> set[str] | None:
        """Which of ``request_ids`` the worker says it does not run; None if it does not answer in time."""
        try:
            probe = _encode(Probe(request_ids))
            answer = await self._nc.request(control_subject(subject), probe, LIVENESS_WAIT * self.silence_timeout)
            return set(_unknown_decoder.decode(answer.data))
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
        it is shutting down), RequestTooLarge if the request is over a size limit, RemoteError if the
        worker reports an error, StreamBroken if the worker dies, goes silent, shuts down mid-stream,
        or frames are lost. Closing the iterator early tells the worker to stop.
        """
        if self._subscription is None:
            raise RuntimeError("RequestClient.start() was not awaited")
        nc = self._nc
        self._next += 1
        reply_to = f"{self._prefix}.{self._next}"
        inbox = self._inboxes[reply_to] = _Inbox(
            self.silence_timeout, self._caught_up, lambda: self._still_running(subject, request_id)
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
                envelope = _encode(Envelope(request_id, msgspec.Raw(payload), self.window))
                await nc.publish(subject, envelope, reply=reply_to)
            except nats.errors.MaxPayloadError as exc:
                finished = True
                raise RequestTooLarge(f"the request is over the NATS payload limit: {exc}") from exc
            expected = 1
            queue = inbox.queue
            while True:
                frame = await queue.get()
                if frame is None:
                    raise StreamBroken(f"{subject} went silent for {self.silence_timeout} s")
                if frame is NO_RESPONDERS:
                    finished = True
                    raise WorkerUnavailable(f"no instance listens on {subject}")
                kind = frame.kind
                if kind == HEARTBEAT:
                    continue
                if kind == CUT:
                    finished = True
                    raise StreamBroken(frame.error)
                if frame.seq == -1:
                    finished = True
                    raise RemoteError(frame.error)
                if frame.seq != expected:
                    raise StreamBroken(f"frames lost on the stream from {subject} (got {frame.seq}, wanted {expected})")
                expected += 1
                if kind == DATA:
                    payloads = frame.payloads
                    if queue.qsize():
                        # Frames that came while this request's task waited its turn go on with this one: a
                        # reader that lags (a busy ingress) makes one pass down the pipeline for all of them
                        # (one detokenizing pass, one SSE event, one socket write) and catches up at a lower
                        # cost per token, as vLLM's output collector merges what its reader has not taken.
                        # A reader that keeps up takes the frames one by one, as they come.
                        expected, kind = _take_following(queue, payloads, expected)
                    if kind == END:
                        finished = True
                        yield payloads
                        return
                    if expected - 1 - acked >= ack_every:
                        acked = expected - 1
                        self._ack(control, request_id, acked)
                    yield payloads
                    continue
                finished = True
                if frame.payloads:
                    yield frame.payloads
                if kind == END:
                    return
                if frame.code == TOO_LARGE:
                    raise RequestTooLarge(frame.error)
                if frame.code == UNAVAILABLE:
                    raise WorkerUnavailable(frame.error)
                raise RemoteError(frame.error)
        finally:
            inbox.close()
            del self._inboxes[reply_to]
            del open_streams[reply_to]
            if not open_streams:
                del self._open[subject]
                self._liveness.pop(subject, None)
            if not finished:
                with contextlib.suppress(nats.errors.Error):
                    await nc.publish(control, _encode(Stop(request_id)))

    def _ack(self, control: str, request_id: str, seq: int) -> None:
        """Queue an ack; the acks of one tick go out as one message per instance."""
        pending = self._acks.get(control)
        if pending is None:
            pending = self._acks[control] = {}
        pending[request_id] = seq
        if self._ack_flush is None:
            self._ack_flush = asyncio.get_running_loop().call_later(self._ack_interval, self._flush_acks)

    def _flush_acks(self) -> None:
        self._ack_flush = None
        acks, self._acks = self._acks, {}
        self._spawn(self._send_acks(acks))

    async def _send_acks(self, acks: dict[str, dict[str, int]]) -> None:
        for control, streams in acks.items():
            with contextlib.suppress(nats.errors.Error):
                await self._nc.publish(control, _encode(Acks(list(streams.items()))))

    async def _probe_forever(self) -> None:
        """Probe every instance with open streams, one probe per instance at a time."""
        while True:
            await asyncio.sleep(self.probe_interval)
            for subject in self._open:
                if subject not in self._probing:
                    self._probing.add(subject)
                    self._spawn(self._probe(subject))

    async def _probe(self, subject: str) -> None:
        try:
            await self._nc.request(control_subject(subject), _PROBE, timeout=self._probe_timeout)
        except nats.errors.NoRespondersError:
            await self._cut(subject)
        except (TimeoutError, nats.errors.Error):
            pass  # no answer in time: a hung worker, which the silence timeout deals with
        finally:
            self._probing.discard(subject)

    async def _cut(self, subject: str) -> None:
        """Break every open stream to ``subject``: its worker's connection is gone.

        The CUT frames travel through NATS to our own inbox rather than straight into the queues, so
        they arrive after every frame the worker sent before it died.
        """
        streams = list(self._open.get(subject, {}))
        log.warning("instance %s is gone (its NATS connection closed): breaking %d stream(s)", subject, len(streams))
        frame = _encode(Frame(CUT, 0, error=f"the worker {subject} is gone (its NATS connection closed)"))
        for reply_to in streams:
            with contextlib.suppress(nats.errors.Error):
                await self._nc.publish(reply_to, frame)
