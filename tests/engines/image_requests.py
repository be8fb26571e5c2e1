"""What the image tests share: a picture as a data URI, and an engine wrapper that keeps the requests it is sent."""

import base64
import io
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from PIL import Image

from frontend_gateway.http_app import GatewayApp
from runtime.engine import RequestContext
from runtime.protocol import EngineOutput, PreprocessedRequest
from tests.frontend_gateway.asgi import call


def data_uri(color: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> str:
    """A plain ``color`` picture of ``size`` as a PNG data URI."""
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


class Recorded:
    """A token engine, keeping the requests the gateway sends it."""

    kind = "token"
    skip_special_tokens = True

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.requests: list[PreprocessedRequest] = []

    def generate(self, request: PreprocessedRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        self.requests.append(request)
        result: AsyncIterator[EngineOutput] = self.engine.generate(request, context)
        return result


async def answer(app: GatewayApp, body: dict[str, Any]) -> dict[str, Any]:
    """The gateway's answer to chat request ``body``, which must be a 200."""
    client = await call(app, "/v1/chat/completions", body)
    assert client.status == 200, client.content
    result: dict[str, Any] = msgspec.json.decode(client.content)
    return result
