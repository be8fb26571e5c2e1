"""Image inputs of chat requests: ``image_url`` content parts, found, checked and loaded by the gateway.

A part is ``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}``, as OpenAI's and vLLM's servers
take it. The URL is a ``data:image/...;base64,`` URI (decoded here) or an http(s) URL, fetched here with httpx
within ``ImageLimits.fetch_timeout_s`` and ``max_bytes``; any other scheme (``file://`` above all: the gateway's
own files) is refused. Every image is opened with Pillow before it goes further, so a part that is not an image
is the client's 400 naming it (``messages[1].content[0]``), not an engine's failure after routing. Decoding and
checking run on a thread: a large image costs tens of milliseconds that every stream of the process would wait.

Without ``--image-domains`` an image URL must name a public host: one that resolves to a loopback, private,
link-local or otherwise reserved address (the gateway's own machine, etcd, the control plane, a cloud's
metadata service) is refused, redirects included, so that a client cannot make the gateway probe the
fleet's network. The addresses checked are the ones connected to: the client's connections resolve each host
once, check every address, and connect to a checked one (``_PublicAddressesOnly``), so a name that resolves
to a public address for the check and to a private one a moment later (DNS rebinding) gets nowhere. Naming
hosts in ``--image-domains`` allows those, whatever their addresses.

Models whose card does not say ``vision`` take text only: a request with an image part is refused naming the
part before any image is fetched (``refuse_images``).
"""

import asyncio
import base64
import binascii
import hashlib
import io
import ipaddress
import logging
import re
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpcore
import httpx
from PIL import Image, UnidentifiedImageError

from frontend_gateway.errors import InvalidRequest
from frontend_gateway.openai_api.image_limits import ImageLimits
from frontend_gateway.openai_api.types import ChatCompletionRequest
from runtime.models.card import ModelCard
from runtime.protocol import ImageInput

log = logging.getLogger(__name__)

#: At most this many images a request (vLLM's default ``limit_mm_per_prompt`` is model-dependent; a bound
#: keeps one request from holding hundreds of megabytes here).
MAX_IMAGES = 16
#: Pixels an image may have: Pillow's own bomb check refuses only past ~179 million, and decoding that many
#: holds half a gigabyte.
MAX_PIXELS = 50_000_000
_DATA_URI = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<data>.*)", re.DOTALL)
#: What part types a chat message's content may hold here.
PART_TYPES = ("text", "image_url")


@dataclass(frozen=True, slots=True)
class ImagePart:
    """An ``image_url`` part of a request: its URL (None: the part lacks ``image_url``, refused when loaded), and
    the parameter that names it in errors."""

    url: str | None
    param: str


@dataclass(frozen=True, slots=True)
class LoadedImage:
    """An image's file bytes, checked to be an image, and their SHA-256 (hex)."""

    data: bytes
    digest: str


def image_parts(request: ChatCompletionRequest) -> list[ImagePart]:
    """The request's image parts, in prompt order. Raises InvalidRequest naming a part of a type not taken
    here, or the part past ``MAX_IMAGES``."""
    parts: list[ImagePart] = []
    for index, message in enumerate(request.messages):
        if not isinstance(message.content, list):
            continue
        for number, part in enumerate(message.content):
            param = f"messages[{index}].content[{number}]"
            if part.type not in PART_TYPES:
                raise InvalidRequest(
                    f"content part of type {part.type!r} is not supported; text and image_url parts are",
                    param=f"{param}.type",
                )
            if part.type != "image_url":
                continue
            if len(parts) == MAX_IMAGES:
                raise InvalidRequest(f"at most {MAX_IMAGES} images a request", param=param)
            parts.append(ImagePart(part.image_url.url if part.image_url is not None else None, param))
    return parts


def refuse_images(parts: Sequence[ImagePart], *, model: str, vision: bool) -> None:
    """Raises InvalidRequest naming the first image part when the model takes text only."""
    if parts and not vision:
        raise InvalidRequest(
            f"model {model!r} takes text only; it cannot be given images (a vision model served by out=vllm can)",
            param=parts[0].param,
        )


def place_images(card: ModelCard, prompt_ids: list[int], images: Sequence[LoadedImage]) -> list[ImageInput]:
    """The engine's image inputs: each image at its placeholder token in the rendered prompt, in order.

    Raises InvalidRequest when the chat template did not write one placeholder per image (a template that
    ignores image parts, or text that holds the placeholder token itself): the model would be given images
    the prompt has no place for.
    """
    token = card.image_token_id
    positions = [at for at, token_id in enumerate(prompt_ids) if token_id == token] if token is not None else []
    if len(positions) != len(images):
        raise InvalidRequest(
            f"the chat template of model {card.name!r} placed {len(positions)} image tokens for {len(images)} "
            "images (one per image_url part is needed; text may not hold the image token itself)",
            param="messages",
        )
    tokens = card.image_tokens or 0
    return [
        ImageInput(data=image.data, digest=image.digest, position=at, tokens=tokens)
        for image, at in zip(images, positions, strict=True)
    ]


def prompt_tokens(prompt_ids: Sequence[int], images: Sequence[ImageInput]) -> int:
    """The prompt's tokens as the engine counts them: each image's placeholder widened to its ``tokens``
    (where the gateway knows them; the engine reports the rest: ``EngineOutput.prompt_tokens``)."""
    return len(prompt_ids) + sum(image.tokens - 1 for image in images if image.tokens)


class ImageLoader:
    """Loads image parts: decodes data URIs, fetches http(s) URLs (one httpx client, made on first use),
    checks each is an image. ``aclose()`` closes the client (the app's lifespan does)."""

    def __init__(self, limits: ImageLimits | None = None) -> None:
        self.limits = limits or ImageLimits()
        self._client: httpx.AsyncClient | None = None

    async def load(self, parts: Sequence[ImagePart]) -> list[LoadedImage]:
        """The images of ``parts``, in order, fetched at once. Raises InvalidRequest naming the first part that
        cannot be loaded (the others' fetches are cancelled)."""
        if not parts:
            return []
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._load(part)) for part in parts]
        except* InvalidRequest as failures:
            raise failures.exceptions[0] from None
        return [task.result() for task in tasks]

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def _load(self, part: ImagePart) -> LoadedImage:
        url = part.url
        if url is None:
            raise InvalidRequest("an image_url part needs image_url: {url}", param=f"{part.param}.image_url")
        if url[:5].lower() == "data:":
            return await asyncio.to_thread(_decode_data_uri, url, part.param, self.limits.max_bytes)
        data = await self._fetch(url, part.param)
        return await asyncio.to_thread(_checked, data, part.param)

    async def _fetch(self, url: str, param: str) -> bytes:
        """The body of an http(s) URL, within the limits. Raises InvalidRequest for another scheme, a host not
        allowed, an answer other than 200, one over ``max_bytes``, a fetch past the deadline, a failed one."""
        limits = self.limits
        shown = _shown(url)
        _check_url(url, param, limits.domains)
        # The host's addresses are checked by the request hook (_check_redirect, for the URL and each redirect)
        # and again by the connection itself (_PublicAddressesOnly), which connects only to those it checked.
        client = self._client
        if client is None:
            # Redirects are followed, each checked as the URL was (an allowed host may send elsewhere).
            transport = httpx.AsyncHTTPTransport()
            if not limits.domains:
                transport._pool = httpcore.AsyncConnectionPool(
                    ssl_context=httpx.create_ssl_context(), network_backend=_PublicAddressesOnly()
                )
            client = self._client = httpx.AsyncClient(
                transport=transport,
                follow_redirects=True,
                timeout=None,
                event_hooks={"request": [self._check_redirect]},
            )
        try:
            async with asyncio.timeout(limits.fetch_timeout_s):
                async with client.stream("GET", url) as response:
                    if response.status_code != 200:
                        raise InvalidRequest(
                            f"fetching the image at {shown} failed: it answered HTTP {response.status_code}",
                            param=param,
                        )
                    declared = response.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > limits.max_bytes:
                        raise _too_large(shown, limits.max_bytes, param)
                    chunks: list[bytes] = []
                    size = 0
                    async for chunk in response.aiter_bytes():
                        size += len(chunk)
                        if size > limits.max_bytes:
                            raise _too_large(shown, limits.max_bytes, param)
                        chunks.append(chunk)
        except TimeoutError:
            log.info("an image fetch from %s took over %g s; refused", shown, limits.fetch_timeout_s)
            raise InvalidRequest(
                f"the image at {shown} did not arrive within {limits.fetch_timeout_s:g} s", param=param
            ) from None
        except _NotAllowed as exc:
            raise InvalidRequest(str(exc), param=param) from None
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            log.info("an image fetch from %s failed: %s", shown, exc)
            raise InvalidRequest(f"fetching the image at {shown} failed: {exc}", param=param) from exc
        return b"".join(chunks)

    async def _check_redirect(self, request: httpx.Request) -> None:
        if request.url.scheme not in ("http", "https"):
            raise _NotAllowed(f"an image URL may not lead to a {request.url.scheme}: URL")
        if self.limits.domains and not _allowed_host(request.url.host, self.limits.domains):
            raise _NotAllowed(f"an image URL may not lead to {request.url.host!r}: images come from {_domains(self)}")
        if not self.limits.domains:
            await _check_public(request.url)


async def _check_public(url: httpx.URL) -> None:
    """Raises _NotAllowed unless every address ``url``'s host resolves to is a public one."""
    await _public_addresses(url.host, url.port or 443)


async def _public_addresses(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to, each checked to be public; raises _NotAllowed if one is not, or if
    it does not resolve."""
    try:
        found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise _NotAllowed(f"the image host {host!r} cannot be resolved ({exc.strerror or exc})") from None
    addresses = []
    for *_, address in found:
        ip = ipaddress.ip_address(address[0])
        if not ip.is_global or ip.is_multicast:
            raise _NotAllowed(
                f"the image host {host!r} is at {ip}, not a public address: the gateway fetches images only from "
                "public hosts unless --image-domains (FLOTILLA_IMAGE_DOMAINS) names the host"
            )
        addresses.append(str(ip))
    return addresses


class _PublicAddressesOnly(httpcore.AsyncNetworkBackend):
    """httpcore's network backend for image fetches without ``--image-domains``: a connection resolves its host
    once, checks every address (``_public_addresses``) and connects to one of those very addresses, never
    resolving again. TLS still names the host (httpcore gives the URL's host as the server name)."""

    def __init__(self) -> None:
        self._backend = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        failed: httpcore.ConnectError | None = None
        for address in await _public_addresses(host, port):
            try:
                return await self._backend.connect_tcp(address, port, timeout, local_address, socket_options)
            except httpcore.ConnectError as exc:  # the next address, as a resolver's caller would try
                failed = exc
        raise failed or httpcore.ConnectError(f"{host!r} resolved to no address")

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise _NotAllowed("an image URL may not lead to a Unix socket")

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


class _NotAllowed(Exception):
    """A redirect to a scheme or host an image URL may not name (raised inside httpx's request hook)."""


def _domains(loader: ImageLoader) -> str:
    return ", ".join(loader.limits.domains)


def _check_url(url: str, param: str, domains: tuple[str, ...]) -> None:
    parsed = urlsplit(url)
    scheme = parsed.scheme.lower()
    if scheme not in ("http", "https"):
        raise InvalidRequest(
            "an image URL is an http(s) URL or a data:image/...;base64, URI"
            + (f", not a {scheme}: URL" if scheme else ""),
            param=param,
        )
    if domains and not _allowed_host(parsed.hostname or "", domains):
        raise InvalidRequest(
            f"images are fetched only from {', '.join(domains)}; {parsed.hostname!r} is not among them", param=param
        )


def _allowed_host(host: str, domains: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    return any(host == domain or host.endswith("." + domain) for domain in domains)


def _shown(url: str) -> str:
    """The URL as errors and logs show it: without its query (it may hold a signature), cut short."""
    parsed = urlsplit(url)
    text = f"{parsed.scheme}://{parsed.netloc}{parsed.path}"
    return text if len(text) <= 120 else text[:117] + "..."


def _too_large(shown: str, limit: int, param: str) -> InvalidRequest:
    return InvalidRequest(f"the image at {shown} is over the limit of {limit} bytes", param=param)


def _decode_data_uri(uri: str, param: str, max_bytes: int) -> LoadedImage:
    """A ``data:image/...;base64,`` URI's image (on a thread: decoding and checking cost milliseconds per MB)."""
    match = _DATA_URI.fullmatch(uri)
    if match is None or ";base64" not in match["params"].lower():
        raise InvalidRequest("an image data URI is data:image/<type>;base64,<data>", param=param)
    if not match["type"].lower().startswith("image/"):
        raise InvalidRequest(f"a data URI of type {match['type']!r} is not an image", param=param)
    encoded = match["data"]
    if len(encoded) // 4 * 3 > max_bytes + 2:
        raise InvalidRequest(f"the image is over the limit of {max_bytes} bytes", param=param)
    try:
        data = base64.b64decode(encoded, validate=True)
    except binascii.Error as exc:
        raise InvalidRequest(f"the image data URI is not valid base64: {exc}", param=param) from exc
    if len(data) > max_bytes:
        raise InvalidRequest(f"the image is over the limit of {max_bytes} bytes", param=param)
    return _checked(data, param)


def _checked(data: bytes, param: str) -> LoadedImage:
    """``data`` with its digest, once Pillow has decoded it whole. Raises InvalidRequest for what it cannot."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > MAX_PIXELS:
                raise InvalidRequest(
                    f"the image is {width}x{height}, over the limit of {MAX_PIXELS} pixels", param=param
                )
            image.load()
    except InvalidRequest:
        raise
    except UnidentifiedImageError as exc:
        raise InvalidRequest(
            "the data is not an image that can be read: no image format (PNG, JPEG, WebP, GIF...) knows it", param=param
        ) from exc
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        # OSError for truncated or corrupt data; SyntaxError and ValueError from some format readers.
        raise InvalidRequest(f"the data is not an image that can be read: {exc}", param=param) from exc
    return LoadedImage(data, hashlib.sha256(data).hexdigest())
