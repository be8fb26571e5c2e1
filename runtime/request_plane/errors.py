"""What the request plane raises: one hierarchy under RequestPlaneError."""

from runtime.errors import FlotillaError


class RequestPlaneError(FlotillaError):
    """A request could not be delivered or its stream broke."""


class WorkerUnavailable(RequestPlaneError):
    """No instance listens on the subject, or it is shutting down; nothing was generated."""


class WorkerBusy(WorkerUnavailable):
    """The instance refused the request because its own queue is full; nothing was generated."""


class StreamBroken(RequestPlaneError):
    """The stream stopped mid-way: the worker died, went silent, was shut down, or frames were lost.

    ``cause`` says which, in one word for metrics: ``cut`` (the worker shut down, or its connection
    closed), ``silent`` (nothing heard for the silence timeout), ``frames_lost``, or ``stalled``
    (StreamStalled)."""

    def __init__(self, message: str, *, cause: str = "cut") -> None:
        super().__init__(message)
        self.cause = cause


class StreamStalled(StreamBroken):
    """The worker is there but sent no output within the progress deadline: its engine is stuck."""

    def __init__(self, message: str) -> None:
        super().__init__(message, cause="stalled")


class RemoteError(RequestPlaneError):
    """The worker reported an error for this request."""


class RequestRefused(RemoteError):
    """The worker's engine refused the request as the client's error (RequestRejected there), with its reason."""


class RequestTooLarge(RemoteError):
    """The request is over the worker's (or NATS's) size limit; nothing was generated."""
