"""The request plane: one request to one chosen instance over NATS, its response streamed back.

Protocol (all messages msgpack):

* The client subscribes to a fresh inbox, then sends ``Envelope(request_id, reply_to=inbox, payload)``
  to the instance's subject as a NATS request. The worker answers that request at once with an
  ``ACCEPTED`` frame (or an ``ERROR`` frame if it cannot take it), so a dead or missing instance is
  known before anything is generated (NATS says "no responders" when nobody listens).
* The worker then publishes ``Frame(kind, seq, payload)`` to the inbox: ``DATA`` frames in order,
  then ``END`` or ``ERROR``. While it has nothing to send it publishes ``HEARTBEAT`` frames, so a
  client that hears nothing for ``silence_timeout`` knows the worker is gone and does not wait forever.
* The client stops a request by publishing ``Control(request_id)`` to ``<subject>.control``.

The payloads are opaque bytes here; the engines' wire types (runtime/protocol.py) go inside.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from runtime.engine import RequestContext
from runtime.errors import FlotillaError

log = logging.getLogger(__name__)

ACCEPTED, DATA, END, ERROR, HEARTBEAT = range(5)
DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # NATS's own default max_payload


class RequestPlaneError(FlotillaError):
    """A request could not be delivered or its stream broke."""


class WorkerUnavailable(RequestPlaneError):
    """The instance did not take the request (gone, or not answering); nothing was generated."""


class StreamBroken(RequestPlaneError):
    """The stream stopped mid-way: the worker went silent, or frames were lost."""


class RemoteError(RequestPlaneError):
    """The worker reported an error for this request."""


class RequestPlaneUnavailable(RequestPlaneError):
    """NATS cannot be reached."""


class Envelope(msgspec.Struct, array_like=True):
    request_id: str
    reply_to: str
    payload: bytes


class Frame(msgspec.Struct, array_like=True):
    kind: int
    seq: int
    payload: bytes = b""


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
        if len(msg.data) > self._max_request_bytes:
            size, limit = len(msg.data), self._max_request_bytes
            log.warning("rejected a %d-byte request on %s (limit %d)", size, self.subject, limit)
            await self._refuse(msg, f"request of {size} bytes is over the limit of {limit}")
            return
        try:
            envelope = _envelope_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("rejected a malformed request on %s: %s", self.subject, exc)
            await self._refuse(msg, f"malformed request envelope: {exc}")
            return
        if envelope.request_id in self._streams:
            await self._refuse(msg, f"request id {envelope.request_id!r} is already running here")
            return
        stream = _Stream(RequestContext(envelope.request_id), envelope.reply_to)
        self._streams[envelope.request_id] = stream
        stream.task = asyncio.create_task(self._answer(envelope, stream), name=f"request {envelope.request_id}")
        if msg.reply:
            await self._nc.publish(msg.reply, _encode(Frame(ACCEPTED, 0)))

    async def _refuse(self, msg: Msg, reason: str) -> None:
        if msg.reply:
            with contextlib.suppress(nats.errors.Error):
                await self._nc.publish(msg.reply, _encode(Frame(ERROR, 0, reason.encode())))

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
        publish = self._nc.publish
        reply_to = envelope.reply_to
        try:
            async for payload in self._handler(envelope.payload, stream.context):
                stream.seq += 1
                stream.last_sent = time.monotonic()
                await publish(reply_to, _encode(Frame(DATA, stream.seq, payload)))
            stream.seq += 1
            await publish(reply_to, _encode(Frame(END, stream.seq)))
        except asyncio.CancelledError:
            pass  # stopped by the client, or by close()
        except Exception as exc:
            log.warning("request %s failed: %s", envelope.request_id, exc, exc_info=not isinstance(exc, FlotillaError))
            with contextlib.suppress(nats.errors.Error):
                stream.seq += 1
                await publish(reply_to, _encode(Frame(ERROR, stream.seq, str(exc).encode())))
        finally:
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


class _Inbox:
    """Client side of one stream: frames queued by the subscription callback, with a silence watchdog."""

    __slots__ = ("_last", "_loop", "_silence", "_timer", "queue")

    def __init__(self, silence_timeout: float) -> None:
        self.queue: asyncio.Queue[Frame | None] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._silence = silence_timeout
        self._last = time.monotonic()
        self._timer = self._loop.call_later(silence_timeout, self._check)

    def on_message(self, msg: Msg) -> None:
        self._last = time.monotonic()
        try:
            self.queue.put_nowait(_frame_decoder.decode(msg.data))
        except msgspec.DecodeError:
            log.warning("ignored a malformed frame on %s", msg.subject)

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

    def __init__(self, nc: NATS, *, accept_timeout: float = 5.0, silence_timeout: float = 5.0) -> None:
        self._nc = nc
        self.accept_timeout = accept_timeout
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

        Raises WorkerUnavailable before the first payload if the instance does not take the request,
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
            envelope = _encode(Envelope(request_id, reply_to, payload))
            try:
                reply = await nc.request(subject, envelope, timeout=self.accept_timeout)
            except nats.errors.NoRespondersError as exc:
                raise WorkerUnavailable(f"no instance listens on {subject}") from exc
            except (TimeoutError, nats.errors.TimeoutError) as exc:
                raise WorkerUnavailable(f"{subject} did not take the request in {self.accept_timeout} s") from exc
            except nats.errors.MaxPayloadError as exc:
                raise RemoteError(f"the request is over the NATS payload limit: {exc}") from exc
            accepted = _frame_decoder.decode(reply.data)
            if accepted.kind != ACCEPTED:
                finished = True
                raise RemoteError(accepted.payload.decode(errors="replace"))
            expected = 1
            while True:
                frame = await inbox.queue.get()
                if frame is None:
                    raise StreamBroken(f"{subject} went silent for {self.silence_timeout} s")
                kind = frame.kind
                if kind == HEARTBEAT:
                    continue
                if frame.seq != expected:
                    raise StreamBroken(f"frames lost on the stream from {subject} (got {frame.seq}, wanted {expected})")
                expected += 1
                if kind == DATA:
                    yield frame.payload
                elif kind == END:
                    finished = True
                    return
                else:
                    finished = True
                    raise RemoteError(frame.payload.decode(errors="replace"))
        finally:
            inbox.close()
            del self._inboxes[reply_to]
            if not finished:
                with contextlib.suppress(nats.errors.Error):
                    await nc.publish(control_subject(subject), _encode(Control(request_id)))


async def connect_nats(url: str, *, name: str, on_event: Callable[[str], Awaitable[None]] | None = None) -> NATS:
    """Connect to NATS, reconnecting for ever after a loss (nats-py re-subscribes by itself).

    Raises RequestPlaneUnavailable when the first connection fails.
    """

    async def note(kind: str) -> None:
        log.warning("NATS %s (%s)", kind, url)
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
    nc = NATS()
    try:
        await nc.connect(url, **options)
    except (TimeoutError, nats.errors.NoServersError, OSError) as exc:
        raise RequestPlaneUnavailable(
            f"cannot reach NATS at {url}; start it with `make services` or set NATS_SERVER"
        ) from exc
    return nc
