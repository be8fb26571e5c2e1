"""What the gateway's ASGI app reads and writes at the HTTP level, apart from its routes: the ASGI types, the
request body's decoding into a request struct (a 400 naming the field), headers, and the watch for a client
that leaves mid-answer."""

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec

from frontend_gateway.errors import InvalidRequest
from frontend_gateway.models.pipeline import Generation
from frontend_gateway.openai_api import unknown_fields

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class ClientDisconnected(Exception):
    """The client went away before the response was complete."""


class DisconnectWatcher:
    """Waits for ``http.disconnect``; when it comes first, stops the generation and cancels us."""

    __slots__ = ("_generation", "_owner", "_task", "disconnected")

    def __init__(self, receive: Receive, generation: Generation) -> None:
        self.disconnected = False
        self._generation = generation
        self._owner = asyncio.current_task()
        self._task = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        if not await wait_for_disconnect(receive):
            return  # closed: the answer is over
        self.disconnected = True
        self._generation.context.stop()
        if self._owner is not None:
            self._owner.cancel()

    def close(self) -> None:
        self._task.cancel()


async def wait_for_disconnect(receive: Receive) -> bool:
    """True once the client has disconnected; False when this task is cancelled first.

    It runs in a task of its own, which its owner cancels when the answer is over. The cancellation
    ends here instead of being stored in the task: a stored CancelledError's traceback holds these
    frames, and through them the whole request (its transport, its generation, the request's task),
    in a cycle that only the garbage collector frees. Every request left one, and under load the
    ingress spent up to 126 ms in one collection on them (bench/trace_replay.py).
    """
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except asyncio.CancelledError:
        return False
    return True


def decode_body(decoder: "msgspec.json.Decoder[Any]", body: bytes) -> Any:
    """Decode and validate a request body; translate msgspec's errors into a 400 that names the field."""
    if not body:
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if (unknown := unknown_fields.refusal(message)) is not None:
            raise unknown from exc
        _, _, path = message.rpartition(" - at `$.")
        raise InvalidRequest(f"invalid request: {message}", param=path.rstrip("`") or None) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc
    except UnicodeDecodeError as exc:  # msgspec lets invalid UTF-8 inside a string through as this
        raise InvalidRequest(f"the request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from exc
    except RecursionError as exc:
        raise InvalidRequest("the request body nests arrays or objects too deeply") from exc


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case, as ASGI gives them), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None
