"""Chat requests' image parts: data URIs decoded, http(s) URLs fetched within limits, each checked to be an image;
text-only models refuse them naming the part; a vision model's engine gets each image at its placeholder."""

import asyncio
import base64
import hashlib
import io
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from PIL import Image

from frontend_gateway.errors import InvalidRequest
from frontend_gateway.http_app import GatewayApp
from frontend_gateway.models.pipeline import ModelRegistry, TokenModel
from frontend_gateway.openai_api.image_limits import ImageLimits
from frontend_gateway.openai_api.images import ImageLoader, ImagePart, LoadedImage, image_parts
from frontend_gateway.openai_api.types import chat_decoder
from runtime.engine import RequestContext
from runtime.models.card import ModelCard
from runtime.models.loading import load_model_card
from runtime.protocol import EngineOutput, PreprocessedRequest
from tests.frontend_gateway.asgi import TokenScript, call


def png(color: tuple[int, int, int], size: tuple[int, int] = (8, 8)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


RED, BLUE = png((255, 0, 0)), png((0, 0, 255))
RELEASE = threading.Event()  # lets the slow page's handler go when the module ends


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


class _Pages(BaseHTTPRequestHandler):
    served = 0  # GETs answered, every page

    def do_GET(self) -> None:
        _Pages.served += 1
        if self.path == "/red.png":
            self._send(200, RED)
        elif self.path == "/big.png":
            self._send(200, b"\0" * 4096)
        elif self.path == "/elsewhere":
            self.send_response(302)
            self.send_header("location", f"http://localhost:{self.server.server_address[1]}/red.png")
            self.send_header("content-length", "0")
            self.end_headers()
        elif self.path == "/slow.png":
            RELEASE.wait()
        else:
            self._send(404, b"no such page")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return None


@pytest.fixture(scope="module")
def pages() -> Iterator[str]:
    """A real HTTP server on a free loopback port, serving the images above."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Pages)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    RELEASE.set()
    server.shutdown()
    server.server_close()


#: The test server is on loopback, which the gateway fetches from only when --image-domains names it.
LOCAL = ImageLimits(domains=("127.0.0.1",))


async def load(url: str, limits: ImageLimits | None = None) -> LoadedImage:
    loader = ImageLoader(limits)
    try:
        (image,) = await loader.load([ImagePart(url, "messages[0].content[1]")])
    finally:
        await loader.aclose()
    return image


async def refused(url: str, limits: ImageLimits | None = None) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        await load(url, limits)
    assert caught.value.param == "messages[0].content[1]"
    return caught.value


async def test_a_data_uri_is_decoded_and_named_by_its_digest() -> None:
    image = await load(data_uri(RED))
    assert image.data == RED and image.digest == hashlib.sha256(RED).hexdigest()


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("data:image/png;base64,@@not base64@@", "not valid base64"),
        (data_uri(RED, "text/plain"), "not an image"),
        (data_uri(b"these bytes are no image"), "not an image that can be read"),
        ("data:image/png," + "x" * 10, "data:image/<type>;base64,<data>"),
        ("file:///etc/passwd", "not a file: URL"),
        ("ftp://example.com/a.png", "not a ftp: URL"),
    ],
)
async def test_a_url_that_is_not_an_image_is_a_400_naming_the_part(url: str, says: str) -> None:
    assert says in (await refused(url)).message


async def test_an_image_over_the_size_limit_is_refused() -> None:
    error = await refused(data_uri(RED + b"\0" * 200), ImageLimits(max_bytes=100))
    assert "over the limit of 100 bytes" in error.message


async def test_an_http_url_is_fetched(pages: str) -> None:
    assert (await load(f"{pages}/red.png", LOCAL)).data == RED


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:2379/v3/kv/range",
        "http://localhost/a.png",
        "http://10.0.0.7/a.png",
        "http://[::1]/a.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://0.0.0.0/a.png",
    ],
)
async def test_without_image_domains_a_host_at_a_private_address_is_refused_unfetched(url: str) -> None:
    """No probing of the fleet's own network (etcd, the control plane, a cloud's metadata service) by URL."""
    error = await refused(url)
    assert "not a public address" in error.message and "--image-domains" in error.message


async def test_a_redirect_to_a_private_address_is_refused(pages: str) -> None:
    loader = ImageLoader()
    request = httpx.Request("GET", f"{pages}/red.png")
    with pytest.raises(Exception, match="not a public address"):
        await loader._check_redirect(request)


async def test_a_failed_fetch_is_a_400_saying_how_it_failed(pages: str) -> None:
    assert "answered HTTP 404" in (await refused(f"{pages}/missing.png", LOCAL)).message
    too_big = ImageLimits(max_bytes=1000, domains=LOCAL.domains)
    assert "over the limit of 1000 bytes" in (await refused(f"{pages}/big.png", too_big)).message
    closed = "http://127.0.0.1:9/red.png"  # the discard port: nothing listens on loopback
    assert "fetching the image at http://127.0.0.1:9/red.png failed" in (await refused(closed, LOCAL)).message


async def test_an_image_url_that_does_not_answer_in_time_is_a_400(pages: str) -> None:
    error = await refused(f"{pages}/slow.png", ImageLimits(fetch_timeout_s=0.2, domains=LOCAL.domains))
    assert "did not arrive within 0.2 s" in error.message


async def test_image_domains_bound_the_hosts_and_their_redirects(pages: str) -> None:
    only_loopback = ImageLimits(domains=("127.0.0.1",))
    assert (await load(f"{pages}/red.png", only_loopback)).data == RED
    assert "only from example.com" in (await refused(f"{pages}/red.png", ImageLimits(domains=("example.com",)))).message
    assert "may not lead to 'localhost'" in (await refused(f"{pages}/elsewhere", only_loopback)).message


def test_parts_of_other_types_are_refused_naming_them() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "audio"}]
    request = chat_decoder.decode(msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": parts}]}))
    with pytest.raises(InvalidRequest) as caught:
        image_parts(request)
    assert caught.value.param == "messages[0].content[1].type"


# --- through the gateway, with SmolLM2's tokenizer as a vision model's (its template given image parts) ------

# A template that writes each image part as <|im_start|> (a special token SmolLM2 has: the placeholder here).
VISION_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|im_start|>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}assistant:"
)
IMAGE_TOKEN = 1  # <|im_start|> in SmolLM2's vocabulary


class RecordingScript(TokenScript):
    """Keeps the requests it is given; says the prompt's widened size, as vLLM does for an image request."""

    def __init__(self) -> None:
        super().__init__([11, 12])
        self.requests: list[PreprocessedRequest] = []

    async def generate(self, request: PreprocessedRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        self.requests.append(request)
        async for output in super().generate(request, context):
            yield output


@pytest.fixture(scope="module")
def text_card(smollm2: Path) -> ModelCard:
    return load_model_card(smollm2)


def vision_card(card: ModelCard, image_tokens: int | None) -> ModelCard:
    return card.replace(
        name="vision", chat_template=VISION_TEMPLATE, vision=True, image_token_id=IMAGE_TOKEN, image_tokens=image_tokens
    )


def chat(model: str, *images: str) -> dict[str, Any]:
    parts = [{"type": "text", "text": "Compare"}, *({"type": "image_url", "image_url": {"url": u}} for u in images)]
    return {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": parts}]}


async def test_a_text_only_model_refuses_an_image_naming_the_part_before_fetching_it(text_card: ModelCard) -> None:
    registry = ModelRegistry()
    engine = RecordingScript()
    registry.add(TokenModel(text_card, engine))
    # An address nothing answers: the refusal comes before any fetch.
    client = await call(GatewayApp(registry), "/v1/chat/completions", chat(text_card.name, "http://127.0.0.1:9/a.png"))
    error = msgspec.json.decode(client.content)["error"]
    assert client.status == 400 and error["param"] == "messages[0].content[1]"
    assert "takes text only" in error["message"]
    assert engine.requests == []


@pytest.mark.parametrize(
    ("part", "status", "message"),
    [
        ({"type": "input_image", "image_url": "http://127.0.0.1:9/a.png"}, 400, "takes text only"),
        ({"type": "input_image", "file_id": "file-abc"}, 400, "images by file_id are not supported"),
        ({"type": "input_file", "file_id": "file-abc"}, 400, "text and input_image parts are"),
    ],
)
async def test_the_responses_apis_input_image_is_refused_by_a_text_only_model_as_chats_image_is(
    text_card: ModelCard, part: dict[str, Any], status: int, message: str
) -> None:
    registry = ModelRegistry()
    engine = RecordingScript()
    registry.add(TokenModel(text_card, engine))
    content = [{"type": "input_text", "text": "Compare"}, part]
    body = {"model": text_card.name, "max_output_tokens": 2, "input": [{"role": "user", "content": content}]}
    client = await call(GatewayApp(registry), "/v1/responses", body)
    error = msgspec.json.decode(client.content)["error"]
    assert client.status == status and message in error["message"], error
    assert engine.requests == []


async def test_a_vision_models_engine_gets_each_image_at_its_placeholder(text_card: ModelCard) -> None:
    registry = ModelRegistry()
    engine = RecordingScript()
    registry.add(TokenModel(vision_card(text_card, 5), engine))
    client = await call(GatewayApp(registry), "/v1/chat/completions", chat("vision", data_uri(RED), data_uri(BLUE)))
    assert client.status == 200, client.content
    (request,) = engine.requests
    assert request.images is not None
    assert [image.data for image in request.images] == [RED, BLUE]
    assert [request.token_ids[image.position] for image in request.images] == [IMAGE_TOKEN, IMAGE_TOKEN]
    assert {image.tokens for image in request.images} == {5}
    # Each image counts the five tokens the engine widens it to, not the one placeholder.
    assert msgspec.json.decode(client.content)["usage"]["prompt_tokens"] == len(request.token_ids) + 2 * 4


async def test_text_holding_the_placeholder_itself_is_refused(text_card: ModelCard) -> None:
    registry = ModelRegistry()
    registry.add(TokenModel(vision_card(text_card, 5), RecordingScript()))
    body = chat("vision", data_uri(RED))
    body["messages"][0]["content"][0]["text"] = "<|im_start|> look"
    client = await call(GatewayApp(registry), "/v1/chat/completions", body)
    error = msgspec.json.decode(client.content)["error"]
    assert client.status == 400 and "placed 2 image tokens for 1 images" in error["message"]


async def test_a_host_that_rebinds_to_a_private_address_after_the_check_is_not_connected_to(
    pages: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DNS rebinding: the name is public when checked and loopback a moment later, when httpx would have
    resolved it again to connect. The connection goes only to an address that was checked."""
    port = int(pages.rsplit(":", 1)[1])
    # Public for the check (the request hook's), loopback for every resolution after it.
    answers = iter(["93.184.215.14"])
    loop = asyncio.get_running_loop()
    resolved: list[str] = []

    async def rebinding(host: str, *args: Any, **kwargs: Any) -> list[Any]:
        if host != "rebind.example":
            return await real(host, *args, **kwargs)
        address = next(answers, "127.0.0.1")
        resolved.append(address)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]

    real = loop.getaddrinfo
    monkeypatch.setattr(loop, "getaddrinfo", rebinding)
    served = _Pages.served
    error = await refused(f"http://rebind.example:{port}/red.png")
    assert "is at 127.0.0.1, not a public address" in error.message
    assert resolved == ["93.184.215.14", "127.0.0.1"]  # the connection's own: refused
    assert _Pages.served == served  # the loopback server saw nothing
