"""Cross-origin requests from browsers (CORS), for the origins the gateway is told to allow (``--allowed-origins``).

A page served from another origin (the dashboard's playground, a web app) that calls the OpenAI API with an
``Authorization`` header makes the browser ask first (a preflight ``OPTIONS``). With no origin allowed (the
default) the gateway answers as before: ``OPTIONS`` is a 405 and no CORS header is sent, so browsers refuse such
calls. For an allowed origin the preflight is a 204 naming the method and headers asked, and each answer carries
``Access-Control-Allow-Origin`` (with ``Vary: Origin``) and exposes the headers a client reads (rate limits, the
request id, the instance that served it). ``*`` allows every origin, as vLLM's server does by default: keys travel
in a header, never in cookies, so no credentials are allowed. An origin not allowed gets a 403 to its preflight.
"""

from collections.abc import Iterable

from frontend_gateway.http_io import Message, Scope, Send, header

_METHODS = b"GET, POST, DELETE, OPTIONS"
#: Headers a browser script may read from an answer (it sees only the simple ones otherwise).
_EXPOSED = (
    b"retry-after, x-request-id, x-flotilla-instance, x-ratelimit-limit-requests, x-ratelimit-remaining-requests, "
    b"x-ratelimit-reset-requests, x-ratelimit-limit-tokens, x-ratelimit-remaining-tokens, x-ratelimit-reset-tokens"
)
#: How long a browser may keep a preflight's answer.
_MAX_AGE = b"600"


class CorsPolicy:
    """The origins allowed to call the gateway from a browser."""

    def __init__(self, origins: Iterable[str]) -> None:
        given = [origin.strip().rstrip("/").lower() for origin in origins if origin.strip()]
        self.any = "*" in given
        self.origins = frozenset(origin for origin in given if origin != "*")

    def __bool__(self) -> bool:
        return self.any or bool(self.origins)

    def allows(self, origin: str) -> bool:
        return self.any or origin.rstrip("/").lower() in self.origins

    async def preflight(self, scope: Scope, send: Send, origin: str) -> None:
        """Answer a preflight from ``origin``: 204 with what it may send, or a 403 saying the origin is not
        allowed."""
        if not self.allows(origin):
            body = (
                b'{"error":{"message":"this origin may not call the gateway from a browser; add it to the '
                b'gateway\'s --allowed-origins (FLOTILLA_ALLOWED_ORIGINS)","type":"invalid_request_error",'
                b'"param":null,"code":"origin_not_allowed"}}'
            )
            headers = [(b"content-type", b"application/json"), (b"vary", b"Origin")]
            await send({"type": "http.response.start", "status": 403, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        asked = header(scope, b"access-control-request-headers") or b"authorization, content-type"
        headers = [
            (b"access-control-allow-origin", origin.encode()),
            (b"access-control-allow-methods", _METHODS),
            (b"access-control-allow-headers", asked),
            (b"access-control-max-age", _MAX_AGE),
            (b"vary", b"Origin"),
        ]
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    def answering(self, send: Send, origin: str) -> Send:
        """``send`` with the CORS headers added to the answer's start, when ``origin`` is allowed."""
        if not self.allows(origin):
            return send
        added = [
            (b"access-control-allow-origin", origin.encode()),
            (b"access-control-expose-headers", _EXPOSED),
            (b"vary", b"Origin"),
        ]

        async def with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *added]}
            await send(message)

        return with_cors


def is_preflight(scope: Scope) -> bool:
    return scope["method"] == "OPTIONS" and header(scope, b"access-control-request-method") is not None
