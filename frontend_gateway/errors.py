"""Errors the gateway answers with, each carrying its HTTP status and OpenAI error type.

One handler (``http_app``) turns them into the OpenAI error envelope; anything else that escapes a
request is logged and answered with a 500 envelope, never a dropped connection.
"""

from collections.abc import Sequence
from http import HTTPStatus

from runtime.errors import EngineBusy, EngineError, EngineStalled, EngineUnavailable, PayloadTooLarge, RequestRejected


class GatewayError(Exception):
    """Base of the errors that map to an HTTP answer."""

    status: HTTPStatus = HTTPStatus.INTERNAL_SERVER_ERROR
    error_type: str = "internal_server_error"
    code: str | None = None
    #: Seconds a client should wait before retrying (sent as ``Retry-After``), or None.
    retry_after: int | None = None
    #: More headers of the answer (a rate limit's ``x-ratelimit-*``).
    headers: Sequence[tuple[bytes, bytes]] = ()

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(GatewayError):
    """The request is malformed or asks for something impossible (400)."""

    status = HTTPStatus.BAD_REQUEST
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """The prompt (plus max_tokens) does not fit the model's context (400)."""

    code = "context_length_exceeded"


class ModelNotFound(GatewayError):
    """No served model has the requested name (404)."""

    status = HTTPStatus.NOT_FOUND
    error_type = "invalid_request_error"
    code = "model_not_found"


class NotFound(GatewayError):
    """No such route (404)."""

    status = HTTPStatus.NOT_FOUND
    error_type = "invalid_request_error"


class MethodNotAllowed(GatewayError):
    status = HTTPStatus.METHOD_NOT_ALLOWED
    error_type = "invalid_request_error"


class RequestTooLarge(GatewayError):
    """The body is over the configured size limit (413)."""

    status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    error_type = "invalid_request_error"
    code = "request_too_large"


class RequestTimeout(GatewayError):
    """The request body did not arrive whole within the body deadline (408); the connection is closed, as
    the rest of a body that late is not worth reading."""

    status = HTTPStatus.REQUEST_TIMEOUT
    error_type = "invalid_request_error"
    code = "request_timeout"
    headers = ((b"connection", b"close"),)


class EngineFailed(GatewayError):
    """The engine failed while generating (500, with the engine's reason)."""

    status = HTTPStatus.INTERNAL_SERVER_ERROR
    error_type = "internal_server_error"


class ToolCallMissing(GatewayError):
    """tool_choice required a call (any, or a named function) and the answer has none, or another (422).

    Not a 500: OpenAI clients retry a 5xx (and 408, 409, 429) on their own, so each retry would generate,
    and charge, the answer again, where the caller may rather change the request (a larger ``max_tokens``,
    ``tool_choice: auto``). A 422 is not retried; the tokens the answer used are charged once.
    """

    status = HTTPStatus.UNPROCESSABLE_ENTITY
    error_type = "model_output_error"
    code = "tool_call_missing"


class ServiceUnavailable(GatewayError):
    status = HTTPStatus.SERVICE_UNAVAILABLE
    error_type = "service_unavailable"


class Overloaded(GatewayError):
    """Every generation slot is busy and the wait queue is full (429 with Retry-After).

    Type and code are the ones OpenAI's own rate-limit answers carry, so clients retry as they would there.
    """

    status = HTTPStatus.TOO_MANY_REQUESTS
    error_type = "requests"
    code = "rate_limit_exceeded"
    retry_after = 1


class QueueTimeout(ServiceUnavailable):
    """The request waited in the admission queue longer than allowed (503 with Retry-After)."""

    code = "queue_timeout"
    retry_after = 2


class AllWorkersBusy(ServiceUnavailable):
    """Every instance of the model is busy (past a busy threshold, or its own queue is full): 503 with
    Retry-After, on which load balancers fail over and clients back off."""

    code = "all_workers_busy"
    retry_after = 1


class EngineTimeout(GatewayError):
    """The engine sent no output within the progress deadline, and the request could not move (504)."""

    status = HTTPStatus.GATEWAY_TIMEOUT
    error_type = "timeout"
    code = "progress_deadline_exceeded"


def from_engine_error(exc: EngineError) -> GatewayError:
    """The answer to a request an engine failed: busy or away is a 503 (with Retry-After when busy), a
    request it refused is the client's error (400, or 413 when too large), a stall a 504, the rest a 500."""
    if isinstance(exc, EngineBusy):
        return AllWorkersBusy(str(exc))
    if isinstance(exc, EngineUnavailable):
        return ServiceUnavailable(str(exc))
    if isinstance(exc, PayloadTooLarge):
        return RequestTooLarge(str(exc))
    if isinstance(exc, RequestRejected):
        return InvalidRequest(str(exc))
    if isinstance(exc, EngineStalled):
        return EngineTimeout(str(exc))
    return EngineFailed(str(exc))
