"""OpenAI's file and batch endpoints (``/v1/files``, ``/v1/batches``), passed on to the control plane.

Batches are the control plane's work (it keeps the files and the batches in its database and runs them
over the fleet with Celery: controlplane/batches/), but clients send them where they send everything
else: to the OpenAI endpoint. This gateway passes such a request on as it came (method, path, query,
``Authorization``, body streamed both ways), and the control plane checks the key against its own
database. Nothing here is on the serving path: generations never wait on the control plane, and while it
is down only these endpoints answer 503, naming it.
"""

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from http import HTTPStatus
from typing import Any
from urllib.parse import quote

import httpx
import msgspec

from frontend_gateway.errors import GatewayError, NotFound
from frontend_gateway.http_io import ClientDisconnected

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

#: The paths passed on: each and everything below it; and below /v1/responses (stored responses: retrieve,
#: delete, input items), whose own path is the gateway's.
PATHS = ("/v1/files", "/v1/batches")
_BELOW = ("/v1/responses/",)
# Request headers the control plane needs; hop-by-hop and the client's others stay here.
_FORWARDED_REQUEST = (b"authorization", b"content-type", b"content-length", b"openai-beta")
# Response headers passed back to the client.
_FORWARDED_RESPONSE = ("content-type", "content-length", "content-disposition", "retry-after")
# Connecting fails fast (the control plane is down: say so); an answer may take a while (a large upload is
# read whole, then stored).
_TIMEOUT = httpx.Timeout(300.0, connect=3.0)
# A stored response is read or written on the answer's path: a control plane slower than this is logged.
_STORE_TIMEOUT = httpx.Timeout(5.0, connect=2.0)


def handles(path: str) -> bool:
    """Whether ``path`` (without a trailing slash) is one this module passes on."""
    return any(path == prefix or path.startswith(prefix + "/") for prefix in PATHS) or path.startswith(_BELOW)


class ControlPlaneUnavailable(GatewayError):
    status = HTTPStatus.SERVICE_UNAVAILABLE
    error_type = "service_unavailable"
    code = "control_plane_unavailable"


class ControlPlaneProxy:
    """Passes requests on to the control plane at ``base_url`` (``--control-plane``)."""

    def __init__(self, base_url: str, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = httpx.AsyncClient(timeout=_TIMEOUT, transport=transport)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the request in ``scope`` on, and its answer back. Raises ControlPlaneUnavailable when the
        control plane cannot be reached or fails mid-answer before a byte was sent back."""
        url = self.base_url + scope["path"]
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        headers = [(name, value) for name, value in scope["headers"] if name in _FORWARDED_REQUEST]
        request = self._client.build_request(
            scope["method"],
            url,
            headers=headers,
            content=_body(receive) if scope["method"] in ("POST", "PUT", "PATCH") else None,
        )
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise ControlPlaneUnavailable(
                f"the file and batch endpoints are the control plane's, and it does not answer at "
                f"{self.base_url} ({type(exc).__name__}: {exc or 'no answer'}); try again once it is back"
            ) from exc
        try:
            headers_out = [
                (name.encode(), value.encode("latin-1"))
                for name, value in response.headers.items()
                if name in _FORWARDED_RESPONSE
            ]
            await send({"type": "http.response.start", "status": response.status_code, "headers": headers_out})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        except httpx.HTTPError as exc:
            # The status is sent: all that can be done is to cut the answer short, and say why here.
            log.warning("the control plane's answer to %s %s broke off: %s", scope["method"], scope["path"], exc)
        finally:
            await response.aclose()

    # --- stored responses (the Responses API's store and previous_response_id) ------------------------

    async def store_response(
        self, authorization: bytes, body: dict[str, Any], input_items: list[Any], conversation: list[Any]
    ) -> bool:
        """Hand the response ``body`` to the control plane to keep, for the key in ``authorization``;
        False (logged) when it is not kept (the response then says ``store: false``)."""
        url = f"{self.base_url}/v1/responses/{body['id']}/store"
        payload = msgspec.json.encode({"response": body, "input_items": input_items, "conversation": conversation})
        headers = {"authorization": authorization.decode("latin-1"), "content-type": "application/json"}
        try:
            answer = await self._client.post(url, content=payload, headers=headers, timeout=_STORE_TIMEOUT)
        except httpx.HTTPError as exc:
            log.warning(
                "response %s not stored: the control plane at %s does not answer (%s)", body["id"], self.base_url, exc
            )
            return False
        if answer.status_code != 200:
            log.warning(
                "response %s not stored: the control plane answered %d: %s",
                body["id"],
                answer.status_code,
                answer.text[:300],
            )
            return False
        return True

    async def conversation(self, authorization: bytes, response_id: str) -> bytes:
        """The items of the conversation that the stored response ``response_id`` ends (JSON). Raises
        ResponseNotFound, or ControlPlaneUnavailable."""
        # The id is the client's: quoted whole, so that no "/", "..", "?" or "#" in it reaches another path.
        url = f"{self.base_url}/v1/responses/{quote(response_id, safe='')}/conversation"
        try:
            answer = await self._client.get(
                url, headers={"authorization": authorization.decode("latin-1")}, timeout=_STORE_TIMEOUT
            )
        except httpx.HTTPError as exc:
            raise ControlPlaneUnavailable(
                f"previous_response_id needs the stored responses, which the control plane keeps, and it does not "
                f"answer at {self.base_url} ({type(exc).__name__}); try again once it is back"
            ) from exc
        if answer.status_code == 404:
            shown = response_id[:100]
            raise ResponseNotFound(f"Previous response with id '{shown}' not found.", param="previous_response_id")
        if answer.status_code != 200:
            raise ControlPlaneUnavailable(
                f"the control plane answered {answer.status_code} for the stored response {response_id[:100]}"
            )
        try:
            return msgspec.json.encode(msgspec.json.decode(answer.content)["items"])
        except (msgspec.DecodeError, KeyError, TypeError) as exc:
            raise ControlPlaneUnavailable("the control plane's answer for a stored response is not one") from exc


class ResponseNotFound(NotFound):
    """``previous_response_id`` names no stored response of the key (404, as OpenAI answers)."""


class NoControlPlane(NotFound):
    """The gateway was started without ``--control-plane``."""


def not_configured(path: str) -> NoControlPlane:
    return NoControlPlane(
        f"{path} is served by the control plane, and this gateway was started without one: start it with "
        f"--control-plane URL (FLOTILLA_CONTROL_PLANE); `flotilla up` does"
    )


async def _body(receive: Receive) -> AsyncIterator[bytes]:
    """The request body as it arrives (an upload is not buffered here). Raises ClientDisconnected."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        if chunk := message.get("body", b""):
            yield chunk
        if not message.get("more_body", False):
            return
