"""The request plane's wire format: the messages, their encoders and decoders, and the subjects."""

from collections.abc import AsyncIterator, Callable

import msgspec

from runtime.engine import RequestContext

DATA, END, ERROR, HEARTBEAT, CUT = range(5)
DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # NATS's own default max_payload
DEFAULT_WINDOW = 16
# Seconds a worker keeps a stream whose window is full while its client says nothing (no ack, no probe).
DEFAULT_ACK_DEADLINE = 5.0
UNLIMITED = 1 << 62

# Frame.code values: why a worker refused a request.
TOO_LARGE = "too_large"
UNAVAILABLE = "unavailable"
BUSY = "busy"  # its own queue is full (FLOTILLA_MAX_WAITING_REQUESTS): another instance may take it
# Why a request failed: its engine refused it as the client's error (runtime.errors.RequestRejected: a bad
# parameter, a prompt over the context length), which its ingress answers with a 400, not a 500.
REJECTED = "rejected"
# Why a worker stopped a stream: its window stayed full with no word from the client past the ack deadline.
ABANDONED = "abandoned"


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
    #: On a HEARTBEAT: the frames of output the worker has sent on all its streams, so that a client
    #: waiting for its first output can tell a worker whose engine works for others from a stuck one.
    progress: int = 0


class Stop(msgspec.Struct, array_like=True, tag=0):
    """Stop generating for this request: its client is gone."""

    request_id: str


class Acks(msgspec.Struct, array_like=True, tag=1):
    """Cumulative acknowledgements: (request id, last DATA frame taken) for streams to one instance."""

    acks: list[tuple[str, int]]


class Probe(msgspec.Struct, array_like=True, tag=2):
    """Are you there? The worker answers with the msgpack list of those ``request_ids`` it does not know."""

    request_ids: list[str] = msgspec.field(default_factory=list)


encode = msgspec.msgpack.encode
envelope_decoder = msgspec.msgpack.Decoder(Envelope)
frame_decoder = msgspec.msgpack.Decoder(Frame)
control_decoder = msgspec.msgpack.Decoder(Stop | Acks | Probe)
unknown_decoder = msgspec.msgpack.Decoder(list[str])

#: A bytes-level request handler: the request's msgpack document in, encoded msgpack documents out.
Handler = Callable[[msgspec.Raw, RequestContext], AsyncIterator[bytes]]


def control_subject(subject: str) -> str:
    return subject + ".control"


# What NATS's "no responders" status message becomes in an inbox's queue.
NO_RESPONDERS = Frame(ERROR, 0, error="no responders")
