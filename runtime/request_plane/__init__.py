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
* Abandoned streams: a worker stops a stream whose window stays full with no ack and no probe naming
  it for ``ack_deadline`` (``FLOTILLA_STREAM_ACK_DEADLINE_S``, 5 s), and aborts its engine request:
  its client was killed or cut off, or its ``Stop`` was lost. A client names its open streams in the
  probes it sends every ``probe_interval``, so a live client that reads slowly keeps them.
* Death detection: while streams to an instance are open, the client probes that instance's control
  subject (a ``Probe`` request) every ``probe_interval``. NATS answers "no responders" at once when the
  worker's connection is gone (a killed process's socket closes); once its probes have been answered
  so back to back for ``gone_after`` (1 s: a connection that blips for half a second reconnects), the
  client cuts every stream to that instance (StreamBroken) without waiting out the silence timeout,
  and sends it no new request for a while. A worker that hangs with its connection open (frozen) is
  found by the silence timeout: its confirming probe waits half a silence timeout when the worker is
  silent on every stream of this client, six when other streams show it alive (slow, not hung).
* Progress: heartbeats prove the worker's event loop runs, not its engine. A stream that waits
  ``progress_deadline`` (``FLOTILLA_STREAM_PROGRESS_DEADLINE_S``) for its next output fails with
  StreamStalled, and so do the other streams of that instance that waited as long; the instance
  gets no new request for a while. Before its first output a request waits its turn for as long as
  the worker's engine sends outputs on other streams (heartbeats carry the worker's count of them).
* Busy: a worker whose queue is full (``FLOTILLA_MAX_WAITING_REQUESTS``) refuses a request with an
  ERROR frame coded BUSY (WorkerBusy) before anything is generated; its client tries another.
* Reconnection: a connection that is reset loses the frames on their way in it. A worker keeps each
  stream's frames until they are acked (and those of a stream that ended, for ``ack_deadline``), and
  sends them all again once it has reconnected to NATS. A client that finds a gap in a stream's frame
  numbers skips the frames past it and those it already has, and waits up to ``silence_timeout`` for
  the missing ones before it gives the stream up (StreamBroken, ``frames_lost``).
* Drain: a worker that shuts down stops taking requests, lets those in flight finish for a grace
  period, then sends each stream still running a ``CUT`` frame, which its client treats as a broken
  stream at once (and migrates).
* The client stops a request by publishing ``Stop(request_id)`` to ``<subject>.control``.

Payloads are msgpack documents (the engines' wire types, runtime/protocol.py) embedded as they are
(``msgspec.Raw``): encoded once by whoever made them, never wrapped as bytes inside bytes.
"""

from runtime.request_plane.client import RequestClient
from runtime.request_plane.errors import (
    RemoteError,
    RequestPlaneError,
    RequestRefused,
    RequestTooLarge,
    StreamBroken,
    StreamStalled,
    WorkerBusy,
    WorkerUnavailable,
)
from runtime.request_plane.server import EndpointServer
from runtime.request_plane.wire import (
    BUSY,
    CUT,
    DATA,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_WINDOW,
    END,
    ERROR,
    HEARTBEAT,
    REJECTED,
    TOO_LARGE,
    UNAVAILABLE,
    Acks,
    Envelope,
    Frame,
    Handler,
    Probe,
    Stop,
    control_subject,
)

__all__ = [
    "BUSY",
    "CUT",
    "DATA",
    "DEFAULT_MAX_REQUEST_BYTES",
    "DEFAULT_WINDOW",
    "END",
    "ERROR",
    "HEARTBEAT",
    "REJECTED",
    "TOO_LARGE",
    "UNAVAILABLE",
    "Acks",
    "EndpointServer",
    "Envelope",
    "Frame",
    "Handler",
    "Probe",
    "RemoteError",
    "RequestClient",
    "RequestPlaneError",
    "RequestRefused",
    "RequestTooLarge",
    "Stop",
    "StreamBroken",
    "StreamStalled",
    "WorkerBusy",
    "WorkerUnavailable",
    "control_subject",
]
