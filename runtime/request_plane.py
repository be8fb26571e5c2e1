"""The request plane: one request to one chosen instance over NATS, its response streamed back.

Protocol (all messages msgpack):

* The client publishes ``Envelope(request_id, payload)`` to the instance's subject, with a reply
  subject on its own inbox. If nobody listens there, NATS itself answers "no responders" on that
  reply subject, so a dead or missing instance is known before anything is generated.
* The worker publishes ``Frame(kind, seq, payloads)`` to the reply subject: ``DATA`` frames in
  order, then ``END`` (which may carry the last payloads) or ``ERROR``. Payloads produced back to back
  travel in one frame, so a fast engine costs few messages. While it has nothing to send the worker
  publishes ``HEARTBEAT`` frames, so a client that hears nothing for ``silence_timeout`` knows the
  worker is gone and does not wait forever.
* The client stops a request by publishing ``Control(request_id)`` to ``<subject>.control``.

The payloads are opaque bytes here; the engines' wire types (runtime/protocol.py) go inside.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from runtime.engine import RequestContext
from runtime.errors import FlotillaError

log = logging.getLogger(__name__)

DATA, END, ERROR, HEARTBEAT = range(4)
DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # NATS's own default max_payload


class RequestPlaneError(FlotillaError):
    """A request could not be delivered or its stream broke."""


class WorkerUnavailable(RequestPlaneError):
    """No instance listens on the subject (it is gone); nothing was generated."""


class StreamBroken(RequestPlaneError):
    """The stream stopped mid-way: the worker went silent, or frames were lost."""


class RemoteError(RequestPlaneError):
    """The worker reported an error for this request."""


class Envelope(msgspec.Struct, array_like=True):
    request_id: str
    payload: bytes


class Frame(msgspec.Struct, array_like=True):
    kind: int
    seq: int
    payloads: list[bytes] = msgspec.field(default_factory=list)
    error: str = ""


class Control(msgspec.Struct, array_like=True):
    request_id: str


_encode = msgspec.msgpack.encode
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_frame_decoder = msgspec.msgpack.Decoder(Frame)
_control_decoder = msgspec.msgpack.Decoder(Control)

Handler = Callable[[bytes, RequestContext], AsyncIterator[bytes]]


def control_subject(subject: str) -> str:
    return subject + ".control"


class _Stream:
    """Server-side state of one request being answered."""

    __slots__ = ("context", "last_sent", "reply_to", "seq", "task")

    def __init__(self, context: RequestContext, reply_to: str) -> None:
        self.context = context
        self.reply_to = reply_to
        self.seq = 0
        self.last_sent = time.monotonic()
        self.task: asyncio.Task[None] | None = None


class EndpointServer:
    """Serves one instance subject with ``handler``; ``close()`` stops taking requests."""

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
        self._subscriptions: list[Subscription] = []
        self._heartbeats: asyncio.Task[None] | None = None

    @property
    def active_requests(self) -> int:
        return len(self._streams)

    async def start(self) -> None:
        self._subscriptions = [
            await self._nc.subscribe(self.subject, cb=self._on_request),
            await self._nc.subscribe(control_subject(self.subject), cb=self._on_control),
        ]
        # Make sure the server has the subscriptions before anyone is told this instance exists.
        await self._nc.flush()
        self._heartbeats = asyncio.create_task(self._heartbeat_loop(), name=f"heartbeats {self.subject}")

    async def close(self) -> None:
        """Stop taking requests, stop the ones running and tell their clients."""
        for subscription in self._subscriptions:
            with contextlib.suppress(nats.errors.Error):
                await subscription.unsubscribe()
        if self._heartbeats is not None:
            self._heartbeats.cancel()
        tasks = [stream.task for stream in self._streams.values() if stream.task is not None]
        for stream in self._streams.values():
            stream.context.stop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _on_request(self, msg: Msg) -> None:
        if not msg.reply:
            log.warning("dropped a request without a reply subject on %s", self.subject)
            return
        if len(msg.data) > self._max_request_bytes:
            size, limit = len(msg.data), self._max_request_bytes
            log.warning("rejected a %d-byte request on %s (limit %d)", size, self.subject, limit)
            await self._refuse(msg.reply, f"request of {size} bytes is over the limit of {limit}")
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
        stream = _Stream(RequestContext(envelope.request_id), msg.reply)
        self._streams[envelope.request_id] = stream
        stream.task = asyncio.create_task(self._answer(envelope, stream), name=f"request {envelope.request_id}")

    async def _refuse(self, reply_to: str, reason: str) -> None:
        with contextlib.suppress(nats.errors.Error):
            await self._nc.publish(reply_to, _encode(Frame(ERROR, 1, error=reason)))

    async def _on_control(self, msg: Msg) -> None:
        try:
            control = _control_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("ignored a malformed control message on %s: %s", self.subject, exc)
            return
        stream = self._streams.get(control.request_id)
        if stream is not None:
            log.debug("request %s stopped by its client", control.request_id)
            stream.context.stop()
            if stream.task is not None:
                stream.task.cancel()

    async def _answer(self, envelope: Envelope, stream: _Stream) -> None:
        """Run the handler and publish what it yields, batching payloads produced back to back."""
        pending: list[bytes] = []
        ready = asyncio.Event()
        failure: list[Exception] = []
        finished = False

        async def produce() -> None:
            nonlocal finished
            try:
                async for payload in self._handler(envelope.payload, stream.context):
                    pending.append(payload)
                    ready.set()
            except Exception as exc:
                failure.append(exc)
            finally:
                finished = True
                ready.set()

        producer = asyncio.create_task(produce())
        publish = self._nc.publish
        try:
            while True:
                await ready.wait()
                ready.clear()
                batch = pending[:]
                pending.clear()
                stream.seq += 1
                stream.last_sent = time.monotonic()
                if not finished:
                    await publish(stream.reply_to, _encode(Frame(DATA, stream.seq, batch)))
                    continue
                if failure:
                    exc = failure[0]
                    log.warning(
                        "request %s failed: %s", envelope.request_id, exc, exc_info=not isinstance(exc, FlotillaError)
                    )
                    await publish(stream.reply_to, _encode(Frame(ERROR, stream.seq, batch, str(exc))))
                else:
                    await publish(stream.reply_to, _encode(Frame(END, stream.seq, batch)))
                return
        except asyncio.CancelledError:
            pass  # stopped by the client, or by close()
        except nats.errors.Error as exc:
            log.warning("request %s: cannot publish its answer: %s", envelope.request_id, exc)
        finally:
            if not producer.done():
                stream.context.stop()
                producer.cancel()
                await asyncio.gather(producer, return_exceptions=True)
            self._streams.pop(envelope.request_id, None)

    async def _heartbeat_loop(self) -> None:
        """Publish a heartbeat on every stream that has been quiet for an interval."""
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
    """Client side of one stream: frames queued by the subscription callback, with a silence watchdog."""

    __slots__ = ("_last", "_loop", "_silence", "_timer", "queue")

    def __init__(self, silence_timeout: float) -> None:
        self.queue: asyncio.Queue[Frame | None] = asyncio.Queue()  # None: the worker went silent
        self._loop = asyncio.get_running_loop()
        self._silence = silence_timeout
        self._last = time.monotonic()
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
        quiet = time.monotonic() - self._last
        if quiet >= self._silence:
            self.queue.put_nowait(None)
        else:
            self._timer = self._loop.call_later(self._silence - quiet, self._check)

    def close(self) -> None:
        self._timer.cancel()


class RequestClient:
    """Sends requests to instance subjects and streams their answers.

    All answers arrive on one wildcard subscription (``<inbox>.*``) and are dispatched by subject,
    so a request costs no SUB/UNSUB round of its own.
    """

    def __init__(self, nc: NATS, *, silence_timeout: float = 5.0) -> None:
        self._nc = nc
        self.silence_timeout = silence_timeout
        self._prefix = nc.new_inbox()
        self._inboxes: dict[str, _Inbox] = {}
        self._subscription: Subscription | None = None
        self._next = 0

    @property
    def connected(self) -> bool:
        return bool(self._nc.is_connected)

    async def start(self) -> None:
        self._subscription = await self._nc.subscribe(self._prefix + ".*", cb=self._dispatch)
        await self._nc.flush()

    async def close(self) -> None:
        if self._subscription is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._subscription.unsubscribe()

    async def _dispatch(self, msg: Msg) -> None:
        inbox = self._inboxes.get(msg.subject)
        if inbox is not None:
            inbox.on_message(msg)

    async def call(self, subject: str, request_id: str, payload: bytes) -> AsyncIterator[bytes]:
        """Yield the DATA payloads of the answer, in order.

        Raises WorkerUnavailable before the first payload if no instance listens on ``subject``,
        RemoteError if the worker reports an error, StreamBroken if it goes silent or frames are lost.
        Closing the iterator early tells the worker to stop.
        """
        if self._subscription is None:
            raise RuntimeError("RequestClient.start() was not awaited")
        nc = self._nc
        self._next += 1
        reply_to = f"{self._prefix}.{self._next}"
        inbox = self._inboxes[reply_to] = _Inbox(self.silence_timeout)
        finished = False
        try:
            try:
                await nc.publish(subject, _encode(Envelope(request_id, payload)), reply=reply_to)
            except nats.errors.MaxPayloadError as exc:
                finished = True
                raise RemoteError(f"the request is over the NATS payload limit: {exc}") from exc
            expected = 1
            while True:
                frame = await inbox.queue.get()
                if frame is None:
                    raise StreamBroken(f"{subject} went silent for {self.silence_timeout} s")
                if frame is NO_RESPONDERS:
                    finished = True
                    raise WorkerUnavailable(f"no instance listens on {subject}")
                kind = frame.kind
                if kind == HEARTBEAT:
                    continue
                if frame.seq == -1:
                    finished = True
                    raise RemoteError(frame.error)
                if frame.seq != expected:
                    raise StreamBroken(f"frames lost on the stream from {subject} (got {frame.seq}, wanted {expected})")
                expected += 1
                for item in frame.payloads:
                    yield item
                if kind == END:
                    finished = True
                    return
                if kind == ERROR:
                    finished = True
                    raise RemoteError(frame.error)
        finally:
            inbox.close()
            del self._inboxes[reply_to]
            if not finished:
                with contextlib.suppress(nats.errors.Error):
                    await nc.publish(control_subject(subject), _encode(Control(request_id)))
