"""The OpenAI HTTP surface as a plain ASGI application.

A small hand-written router instead of a framework: the routes are few and fixed, and each request
on the hot path should cost a dict lookup, one msgspec decode and pre-encoded frames (see
docs/benchmarks.md for what that buys). Every GatewayError becomes the OpenAI error envelope with its
status; anything unexpected is logged and answered 500, never a dropped connection. A failure after a
stream has started ends it with an error event and ``[DONE]``, never a truncated body.

Generation routes pass through ``Admission`` first: beyond the in-flight limit requests wait in a
bounded queue, and what cannot wait is refused at once with 429 or 503 and ``Retry-After``. A client too
slow to send its body, or to take its response, is dropped at a deadline (``slow_clients.py``).
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from frontend_gateway import control_plane_proxy
from frontend_gateway.access.api_keys import KeyTable, check_model
from frontend_gateway.access.concurrency import KeyConcurrency
from frontend_gateway.access.quotas import UNKNOWN_MODEL, Meter, Reservation
from frontend_gateway.admission import Admission, AdmissionLimits
from frontend_gateway.answers import (
    RichFrames,
    as_gateway_error,
    nvext,
    respond_responses,
    response_headers,
    response_id,
)
from frontend_gateway.control_plane_proxy import ControlPlaneProxy
from frontend_gateway.cors import CorsPolicy, is_preflight
from frontend_gateway.errors import (
    GatewayError,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    RequestTooLarge,
)
from frontend_gateway.http_io import (
    JSON_HEADERS,
    SSE_HEADERS,
    ClientDisconnected,
    DisconnectWatcher,
    Message,
    Receive,
    Scope,
    Send,
    decode_body,
    header,
    wait_for_disconnect,
)
from frontend_gateway.metrics import GatewayMetrics
from frontend_gateway.models.pipeline import Generation, ModelRegistry, ServedModel, TokenModel
from frontend_gateway.models.served_names import ServedNames, not_ready
from frontend_gateway.openai_api import (
    best_of,
    chat_choices,
    completion_batch,
    embeddings,
    encoding,
    preprocessor,
    responses_api,
    scoring,
)
from frontend_gateway.openai_api import tokenize as tokenization
from frontend_gateway.openai_api.continuous_usage import with_usage_in_every_chunk
from frontend_gateway.openai_api.embeddings import EmbeddingRequest
from frontend_gateway.openai_api.image_limits import ImageLimits
from frontend_gateway.openai_api.images import ImageLoader, ImagePart, LoadedImage, image_parts, refuse_images
from frontend_gateway.openai_api.logprobs import CompletionLogprobs, chat_logprobs
from frontend_gateway.openai_api.responses_api import ResponseBuilder, ResponsesRequest
from frontend_gateway.openai_api.types import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    chat_decoder,
    completion_decoder,
)
from frontend_gateway.request_log import CLIENT_CLOSED, LOGGED_ENDPOINTS, TimedMetrics, request_record
from frontend_gateway.slow_clients import DEFAULT_BODY_TIMEOUT_S, DEFAULT_SEND_TIMEOUT_S, SlowClients
from runtime.fleet_contract.api_keys import KeyRecord

log = logging.getLogger(__name__)

Lifespan = Callable[[], contextlib.AbstractAsyncContextManager[None]]

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024

# Where a checked request's API key record rides in its ASGI scope, with what its usage is counted from:
# the model it named (when served), its generation, and how the generation ended.
_API_KEY = "flotilla.api_key"
_MODEL = "flotilla.model"
# The name the request asked for, as sent: a refused request for a model the fleet knows is charged to it.
_ASKED = "flotilla.asked_model"
_GENERATION = "flotilla.generation"
_STATUS = "flotilla.status"
_EMBEDDED_TOKENS = "flotilla.embedded_tokens"  # an embeddings request's prompt tokens, for its key's usage
_UNMETERED = "flotilla.unmetered"  # a request passed on to the control plane: not the key's usage here
_RESERVATION = "flotilla.reservation"  # the tokens set aside for it against its key's token limits


class GatewayApp:
    """ASGI app serving the models in ``models``. ``lifespan`` (optional) runs around serving."""

    def __init__(
        self,
        models: ModelRegistry,
        *,
        metrics: GatewayMetrics | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        limits: AdmissionLimits | None = None,
        lifespan: Lifespan | None = None,
        api_keys: KeyTable | None = None,
        meter: Meter | None = None,
        served_names: ServedNames | None = None,
        max_concurrent_per_key: int | None = None,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
        send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
        control_plane: ControlPlaneProxy | None = None,
        image_limits: ImageLimits | None = None,
        allowed_origins: tuple[str, ...] = (),
    ) -> None:
        self.models = models
        #: The origins whose pages may call the gateway from a browser (frontend_gateway/cors.py); none by default.
        self.cors = CorsPolicy(allowed_origins)
        #: Loads chat requests' images (data URIs, http(s) URLs); its client is closed with the app.
        self.images = ImageLoader(image_limits)
        self.metrics = metrics or GatewayMetrics()
        self.max_body_bytes = max_body_bytes
        self.slow_clients = SlowClients(self.metrics, body_timeout_s=body_timeout_s, send_timeout_s=send_timeout_s)
        self.admission = Admission(limits or AdmissionLimits(), self.metrics)
        self._lifespan = lifespan
        #: When set, every /v1/* request needs one of its keys (frontend_gateway/access/api_keys.py).
        self.api_keys = api_keys
        #: Counts keyed requests against their limits, and their usage (frontend_gateway/access/quotas.py).
        self.meter = meter
        #: Each key's requests in progress here, against its cap (frontend_gateway/access/concurrency.py).
        self.key_concurrency = KeyConcurrency(max_concurrent_per_key)
        #: The control plane's served names: a model with none of its replicas here is then a 503, not a 404.
        self.served_names = served_names
        #: Where /v1/files and /v1/batches go (frontend_gateway/control_plane_proxy.py); None: a 404 saying so.
        self.control_plane = control_plane
        self._routes: dict[str, tuple[str, Callable[[Scope, Receive, Send], Awaitable[None]]]] = {
            "/v1/chat/completions": ("POST", self._chat),
            "/v1/completions": ("POST", self._completions),
            "/v1/responses": ("POST", self._responses),
            "/v1/embeddings": ("POST", self._embeddings),
            "/v1/models": ("GET", self._list_models),
            "/v1/score": ("POST", self._score),
            "/v1/rerank": ("POST", self._rerank),
            "/v1/tokenize": ("POST", self._tokenize),
            "/v1/detokenize": ("POST", self._detokenize),
            # vLLM serves these two without the /v1 prefix; clients written against it call them there.
            "/tokenize": ("POST", self._tokenize),
            "/detokenize": ("POST", self._detokenize),
            "/score": ("POST", self._score),
            "/rerank": ("POST", self._rerank),
            "/v2/rerank": ("POST", self._rerank),  # Cohere's v2 path, which vLLM serves too
            "/health": ("GET", self._health),
            "/live": ("GET", self._live),
            "/metrics": ("GET", self._metrics),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._run_lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        origin = header(scope, b"origin") if self.cors else None
        if origin is not None:
            if is_preflight(scope):
                await self.cors.preflight(scope, send, origin.decode("latin-1"))
                return
            send = self.cors.answering(send, origin.decode("latin-1"))
        deadline = self.slow_clients.watch_sends(scope, send)
        try:
            await self._serve(scope, receive, deadline.send)
        except asyncio.CancelledError:
            if not deadline.dropped:
                raise
            # Cancelled by the deadline (a server whose connection it cannot abort): the generation is closed.
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
        finally:
            deadline.close()

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrived, started = time.time(), time.perf_counter()
        status, error = 200, ""  # what the request log records
        try:
            path = scope["path"].rstrip("/") or "/"
            route = self._routes.get(path)
            if route is None and path.startswith(_MODEL_PREFIX):
                route = ("GET", self._retrieve_model)
            if route is None and control_plane_proxy.handles(path):
                route = (scope["method"], self._forward_to_control_plane)
            if route is None:
                raise NotFound(f"no route for {scope['path']}; see /v1/models, /v1/chat/completions, /v1/completions")
            method, handler = route
            if scope["method"] != method and not (method == "GET" and scope["method"] == "HEAD"):
                raise MethodNotAllowed(f"{scope['path']} takes {method}, not {scope['method']}")
            counted: KeyRecord | None = None
            if self.api_keys is not None and (path.startswith("/v1/") or path in _KEYED_WITHOUT_V1):
                key = scope[_API_KEY] = self.api_keys.check(header(scope, b"authorization"))
                # Generations and embeddings (the POST routes) count among the key's concurrent requests.
                if method == "POST" and self.key_concurrency.enter(key):
                    counted = key
                if self.meter is not None and (key.requests_per_minute or key.tokens_per_minute) is not None:
                    send = _with_limit_headers(send, self.meter, key)
            try:
                await handler(scope, receive, send)
            finally:
                if counted is not None:
                    self.key_concurrency.leave(counted)
            self._count_usage(scope, failed=scope.get(_STATUS) == "error")
            error = _ended_by(scope)
        except GatewayError as exc:
            status, error = int(exc.status), exc.error_type
            self._count_usage(scope, failed=True)
            if exc.status >= 500 and exc.retry_after is None:  # refusals under load are counted, not logged
                log.warning("%s %s failed: %s (HTTP %d)", scope["method"], scope["path"], exc.message, exc.status)
            await self._send_error(send, exc)
        except ClientDisconnected:
            status, error = CLIENT_CLOSED, "cancelled"
        except Exception:
            status, error = 500, "internal_error"
            log.exception("unexpected error serving %s", scope.get("path"))
            await self._send_error(send, GatewayError("internal error; see the server log"))
        finally:
            self._release(scope)
            if self.models.request_log is not None and (endpoint := LOGGED_ENDPOINTS.get(scope["path"])) is not None:
                self._log_request(scope, endpoint, arrived, time.perf_counter() - started, status, error)

    async def _send_error(self, send: Send, exc: GatewayError) -> None:
        self.metrics.error(exc.error_type, int(exc.status))
        body = encoding.error_body(exc.message, exc.error_type, exc.code, exc.param)
        headers = JSON_HEADERS
        if exc.retry_after is not None:
            headers = [*headers, (b"retry-after", str(exc.retry_after).encode())]
        if exc.headers:
            headers = [*headers, *exc.headers]
        with contextlib.suppress(Exception):  # the response may already have started
            await send({"type": "http.response.start", "status": int(exc.status), "headers": headers})
            await send({"type": "http.response.body", "body": body})

    async def _run_lifespan(self, receive: Receive, send: Send) -> None:
        message = await receive()
        assert message["type"] == "lifespan.startup"
        stack = contextlib.AsyncExitStack()
        stack.push_async_callback(self.images.aclose)
        try:
            if self._lifespan is not None:
                await stack.enter_async_context(self._lifespan())
        except Exception as exc:
            log.exception("start-up failed")
            await send({"type": "lifespan.startup.failed", "message": str(exc)})
            return
        await send({"type": "lifespan.startup.complete"})
        message = await receive()
        try:
            await stack.aclose()
        except Exception as exc:
            log.exception("shutdown failed")
            await send({"type": "lifespan.shutdown.failed", "message": str(exc)})
            return
        await send({"type": "lifespan.shutdown.complete"})

    # --- simple GET routes -------------------------------------------------------------------

    async def _send_json(self, send: Send, body: bytes, status: int = 200) -> None:
        await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS})
        await send({"type": "http.response.body", "body": body})

    async def _list_models(self, scope: Scope, receive: Receive, send: Send) -> None:
        key: KeyRecord | None = scope.get(_API_KEY)
        data = [_model_object(model) for model in self.models.all() if key is None or key.allows_model(model.name)]
        await self._send_json(send, msgspec.json.encode({"object": "list", "data": data}))

    async def _retrieve_model(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /v1/models/{id}`` (the client's ``models.retrieve``); the id may hold slashes (``org/name``)."""
        model = await self._find_model(scope["path"].rstrip("/")[len(_MODEL_PREFIX) :], scope)
        await self._send_json(send, msgspec.json.encode(_model_object(model)))

    async def _forward_to_control_plane(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``/v1/files`` and ``/v1/batches``: the control plane's (frontend_gateway/control_plane_proxy.py)."""
        scope[_UNMETERED] = True  # not a generation: the batch's own requests are counted as they run
        if self.control_plane is None:
            raise control_plane_proxy.not_configured(scope["path"])
        await self.control_plane.forward(scope, receive, send)

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        """200 while the gateway can serve: a model, and (distributed) NATS to reach its instances. etcd
        lost only freezes the models known: reported, not a 503 that would empty a load balancer."""
        names = self.models.names()
        body: dict[str, Any] = {"status": "healthy" if names else "no models", "models": names}
        if (serving := self.models.status) is not None:
            status = serving()
            body.update(nats=status.nats, etcd=status.etcd, instances=status.instances)
            if not status.nats:
                body["status"] = "NATS unreachable"
            elif names and not status.etcd:
                body["status"] = "etcd unreachable"
        ok = bool(names) and body["status"] != "NATS unreachable"
        await self._send_json(send, msgspec.json.encode(body), 200 if ok else 503)

    async def _live(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._send_json(send, b'{"status":"live"}')

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": self.metrics.exposition()})

    # --- generation routes -------------------------------------------------------------------

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        """Read the whole body, refusing more than ``max_body_bytes`` without buffering it all. Raises
        RequestTimeout when it has not arrived whole within the body deadline."""
        return await self.slow_clients.body_within_deadline(scope, self._receive_body(scope, receive))

    async def _receive_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError as exc:
                    raise InvalidRequest("the Content-Length header is not a number") from exc
                if declared > limit:
                    raise RequestTooLarge(f"the request body is {declared} bytes; the limit is {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise RequestTooLarge(f"the request body is over the limit of {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _find_model(self, name: str, scope: Scope) -> ServedModel:
        scope[_ASKED] = name
        key: KeyRecord | None = scope.get(_API_KEY)
        if key is not None:
            check_model(key, name)  # first: a key learns nothing of the models outside its list
        model = self.models.get(name)
        if model is None and self.models.arrival is not None:
            # Its first worker may have just registered (the agent reports it ready then): the ingress
            # builds the pool in a few hundred ms, and a client acting on "ready" is served, not refused.
            await self.models.arrival(name)
            model = self.models.get(name)
        if model is not None:
            scope[_MODEL] = model.name  # for its key's usage (a name no model has is not kept)
        if model is None:
            if self.served_names is not None and (state := self.served_names.state(name)) is not None:
                raise not_ready(name, state)
            served = ", ".join(n for n in self.models.names() if key is None or key.allows_model(n)) or "none yet"
            shown = name if len(name) <= 200 else name[:200] + "..."  # a client may send megabytes here
            raise ModelNotFound(f"the model {shown!r} does not exist; served models: {served}", param="model")
        return model

    async def _charge(self, scope: Scope) -> None:
        """Count the request against its key's limits. Raises RateLimited or QuotaExhausted (429)."""
        key: KeyRecord | None = scope.get(_API_KEY)
        if key is None or self.meter is None:
            return
        if not self.meter.knows(key):
            # First sight of the key here (or after it was idle): its fleet totals before admitting, or a
            # key whose budget is used up would pass until the next flush (at most LOAD_TIMEOUT_S).
            await self.meter.load(key)
        self.meter.charge(key)

    def _reserve(self, scope: Scope, tokens: int, **messages: str) -> None:
        """Set ``tokens`` (the most the request may use) aside against its key's token limits, until it ends.
        Raises RateLimited or QuotaExhausted (429) when they do not fit (``messages``: see Meter.reserve)."""
        key: KeyRecord | None = scope.get(_API_KEY)
        if key is not None and self.meter is not None:
            scope[_RESERVATION] = self.meter.reserve(key, tokens, **messages)

    def _release(self, scope: Scope) -> None:
        """Settle a reservation that no usage count did (an unexpected error, a cancelled task) with the
        tokens known to be used."""
        reservation: Reservation | None = scope.get(_RESERVATION)
        if reservation is None or reservation.settled or self.meter is None:
            return
        generation: Generation | None = scope.get(_GENERATION)
        if generation is not None:
            self.meter.settle(reservation, generation.prompt_tokens + generation.completion_tokens)
        else:
            self.meter.settle(reservation, scope.get(_EMBEDDED_TOKENS) or 0)

    def _count_usage(self, scope: Scope, *, failed: bool) -> None:
        """Add a finished request to its key's usage (by model and day), with the tokens it used."""
        key: KeyRecord | None = scope.get(_API_KEY)
        generation: Generation | None = scope.get(_GENERATION)
        embedded: int | None = scope.get(_EMBEDDED_TOKENS)
        if key is None or self.meter is None or scope.get(_UNMETERED):
            return
        if generation is None and embedded is None and not failed:
            return  # a listing of models, say: usage counts generations, embeddings and failed requests
        reservation: Reservation | None = scope.get(_RESERVATION)
        if generation is None:
            model = scope.get(_MODEL) or self._known_name(scope.get(_ASKED))
            self.meter.finished(key, model, prompt_tokens=embedded or 0, error=failed, reservation=reservation)
            return
        self.meter.finished(
            key,
            scope[_MODEL],
            prompt_tokens=generation.prompt_tokens,
            cached_tokens=generation.cached_tokens or 0,
            completion_tokens=generation.completion_tokens,
            error=failed,
            reservation=reservation,
        )

    def _log_request(
        self, scope: Scope, endpoint: str, arrived: float, duration: float, status: int, error: str
    ) -> None:
        """Hand the finished request's record to the request log (frontend_gateway/request_log.py)."""
        assert self.models.request_log is not None
        key: KeyRecord | None = scope.get(_API_KEY)
        generation: Generation | None = scope.get(_GENERATION)
        model = scope.get(_MODEL) or scope.get(_ASKED)
        self.models.request_log.add(
            request_record(
                arrived,
                endpoint,
                status,
                error,
                model=model if isinstance(model, str) else "",
                api_key_id=None if key is None else key.key_id,
                generation=generation,
                embedded_tokens=scope.get(_EMBEDDED_TOKENS),
                duration=duration,
            )
        )

    def _known_name(self, name: str | None) -> str:
        """``name`` when a model has it or a pipeline serves it (a request refused before or while its model
        was looked up: out of its key's models, not ready, bad parameters), else UNKNOWN_MODEL: names that
        nothing serves are not kept apart, or a client could fill the usage tables with made-up names."""
        if name is None:
            return UNKNOWN_MODEL
        if self.models.get(name) is not None:
            return name
        if self.served_names is not None and self.served_names.state(name) is not None:
            return name
        return UNKNOWN_MODEL

    # The slot is taken after the body is read and validated (bad requests never wait behind good
    # ones) and before preprocessing, so the limit also bounds how many prompts are tokenized at once.

    async def _admit(self, receive: Receive) -> None:
        """Take a generation slot; a client that leaves while queued gives its place up at once.

        Without watching for ``http.disconnect`` here, a client that gave up would hold its place
        until the queue timeout and then take a slot for an answer no one reads.
        """
        if self.admission.try_acquire():
            return
        acquiring = asyncio.ensure_future(self.admission.acquire())
        leaving = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait((acquiring, leaving), return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
            if not acquiring.done():
                acquiring.cancel()  # acquire() passes on a slot it was handed meanwhile
                with contextlib.suppress(asyncio.CancelledError):
                    await acquiring
        if acquiring.cancelled():
            raise ClientDisconnected
        acquiring.result()  # Overloaded or QueueTimeout propagate; with a slot, go on

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        request: ChatCompletionRequest = decode_body(chat_decoder, await self._read_body(scope, receive))
        scope[_ASKED] = request.model  # before the checks, whose refusals are charged to it
        preprocessor.check_chat(request)
        parts = image_parts(request)
        disagg = _disagg_override(scope)
        model = await self._find_model(request.model, scope)
        images = await self._load_images(scope, model, parts)
        await self._admit(receive)
        try:
            if (request.n or 1) > 1:
                batch = await chat_choices.prepare(model, request, disagg, images)
                self._reserve(scope, batch.total.token_bound)
                scope[_GENERATION] = batch.total
                scope[_STATUS] = await self._respond(
                    "chat", "chat_completions", model, request, batch.total, receive, send, batch=batch
                )
                return
            generation = await model.prepare_chat(request, images)
            self._reserve(scope, generation.token_bound)
            scope[_GENERATION] = generation
            generation.context.disagg = disagg
            scope[_STATUS] = await self._respond("chat", "chat_completions", model, request, generation, receive, send)
        finally:
            self.admission.release()

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        request: CompletionRequest = decode_body(completion_decoder, await self._read_body(scope, receive))
        scope[_ASKED] = request.model  # before the checks, whose refusals are charged to it
        preprocessor.check_stream_options(request)
        best = best_of.plan(request)
        prompts = completion_batch.choices(best.candidates if best is not None else request)
        disagg = _disagg_override(scope)
        model = await self._find_model(request.model, scope)
        await self._charge(scope)
        await self._admit(receive)
        try:
            # Echo is shaped by the batch's choices (openai_api/echo.py), whatever the number of prompts.
            if len(prompts) > 1 or request.echo:
                scope[_STATUS] = await self._completion_batch(
                    scope, model, request, prompts, disagg, receive, send, best
                )
                return
            generation = await model.prepare_completion(request)
            self._reserve(scope, generation.token_bound)
            scope[_GENERATION] = generation
            generation.context.disagg = disagg
            scope[_STATUS] = await self._respond("completion", "completions", model, request, generation, receive, send)
        finally:
            self.admission.release()

    async def _completion_batch(
        self,
        scope: Scope,
        model: ServedModel,
        request: CompletionRequest,
        prompts: list[completion_batch.Prompt],
        disagg: str | None,
        receive: Receive,
        send: Send,
        best: best_of.BestOf | None = None,
    ) -> str:
        """A completion request with several prompts (openai_api/completion_batch.py), or ``best`` of several
        candidates (openai_api/best_of.py); returns how it ended."""
        if best is None:
            batch = await completion_batch.prepare(model, request, prompts, disagg)
        else:
            try:
                batch = await completion_batch.prepare(model, best.candidates, prompts, disagg)
            except InvalidRequest as exc:
                if exc.param == "logprobs" and not best.show_logprobs:
                    raise best_of.unsupported(model.name, exc) from exc
                raise
            batch.best_of = best
        self._reserve(scope, batch.total.token_bound)
        scope[_GENERATION] = batch.total
        return await self._respond("completion", "completions", model, request, batch.total, receive, send, batch=batch)

    async def _embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/embeddings``, for models whose engine embeds (openai_api/embeddings.py)."""
        request: EmbeddingRequest = decode_body(embeddings.decoder, await self._read_body(scope, receive))
        scope[_ASKED] = request.model  # before the checks, whose refusals are charged to it
        inputs = embeddings.inputs(request)
        model = await self._find_model(request.model, scope)
        card, embedder = embeddings.embedder_of(model)
        await self._charge(scope)
        await self._admit(receive)
        try:
            tokens = await embeddings.count_tokens(card, request, inputs)
            self._reserve(scope, tokens, what="its inputs' tokens", shrink="send fewer or shorter inputs")
            body, scope[_EMBEDDED_TOKENS] = await embeddings.create(card, embedder, request, inputs)
        finally:
            self.admission.release()
        await self._send_json(send, body)

    async def _score(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/score`` (and vLLM's ``/score``): pairs of texts scored by a model that embeds (scoring.py)."""
        request: scoring.ScoreRequest = decode_body(scoring.score_decoder, await self._read_body(scope, receive))
        model = await self._find_model(request.model, scope)
        await self._answer_scores(scope, receive, send, scoring.Scoring(model, request))

    async def _rerank(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/rerank`` (and ``/rerank``, ``/v2/rerank``): documents ranked against a query (scoring.py)."""
        request: scoring.RerankRequest = decode_body(scoring.rerank_decoder, await self._read_body(scope, receive))
        model = await self._find_model(request.model, scope)
        await self._answer_scores(scope, receive, send, scoring.Scoring(model, request))

    async def _answer_scores(self, scope: Scope, receive: Receive, send: Send, job: scoring.Scoring) -> None:
        """Charge, admit, reserve the texts' tokens, then embed them and answer (as embeddings do)."""
        await self._charge(scope)
        await self._admit(receive)
        try:
            tokens = await job.count_tokens()
            self._reserve(scope, tokens, what="its texts' tokens", shrink="send fewer or shorter texts")
            body, scope[_EMBEDDED_TOKENS] = await job.run()
        finally:
            self.admission.release()
        await self._send_json(send, body)

    async def _tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/tokenize`` (and vLLM's ``/tokenize``): a prompt's or a chat's token ids (tokenize.py)."""
        request: tokenization.TokenizeRequest = decode_body(
            tokenization.tokenize_decoder, await self._read_body(scope, receive)
        )
        model = await self._find_model(request.model, scope)
        await self._charge(scope)
        await self._send_json(send, msgspec.json.encode(await tokenization.tokenize(model, request)))

    async def _detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/detokenize`` (and vLLM's ``/detokenize``): token ids as text."""
        request: tokenization.DetokenizeRequest = decode_body(
            tokenization.detokenize_decoder, await self._read_body(scope, receive)
        )
        model = await self._find_model(request.model, scope)
        await self._charge(scope)
        await self._send_json(send, msgspec.json.encode(tokenization.detokenize(model, request)))

    async def _load_images(self, scope: Scope, model: ServedModel, parts: list[ImagePart]) -> list[LoadedImage]:
        """A chat request's images for ``model``: refused for a model that takes none (before the request is
        charged), else loaded before a generation slot is taken, so that an image URL slow to answer holds none."""
        card = model.card if isinstance(model, TokenModel) else None
        refuse_images(parts, model=model.name, vision=card is not None and card.vision)
        await self._charge(scope)
        return await self.images.load(parts)

    async def _responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/responses``: the Responses API over the chat pipeline (openai_api/responses_api.py)."""
        request: ResponsesRequest = decode_body(responses_api.decoder, await self._read_body(scope, receive))
        scope[_ASKED] = request.model  # before the checks, whose refusals are charged to it
        history = await self._history(scope, request)
        chat = responses_api.to_chat(request, history)
        preprocessor.check_chat(chat)
        parts = image_parts(chat)  # input_image parts, as chat's image_url parts
        disagg = _disagg_override(scope)
        model = await self._find_model(chat.model, scope)
        images = await self._load_images(scope, model, parts)
        await self._admit(receive)
        try:
            generation = await model.prepare_chat(chat, images)
            self._reserve(scope, generation.token_bound)
            scope[_GENERATION] = generation
            generation.context.disagg = disagg
            keep = self._keeper(scope, request, history)
            builder = ResponseBuilder(request, response_id=generation.request_id, model=model.name, store=bool(keep))
            scope[_STATUS] = await self._respond(
                "chat", "responses", model, chat, generation, receive, send, builder, keep=keep
            )
        finally:
            self.admission.release()

    async def _history(self, scope: Scope, request: ResponsesRequest) -> list[responses_api.InputItem]:
        """The conversation that ``previous_response_id`` names, read from the control plane (the key's own).
        Raises InvalidRequest where no responses are stored, ResponseNotFound, ControlPlaneUnavailable."""
        if request.previous_response_id is None:
            return []
        authorization = header(scope, b"authorization")
        if self.control_plane is None or scope.get(_API_KEY) is None or authorization is None:
            raise InvalidRequest(
                "previous_response_id needs stored responses, which a fleet's control plane keeps for API keys, and "
                "this gateway has none (no --control-plane, or no API keys); send the whole conversation as input",
                param="previous_response_id",
            )
        items = await self.control_plane.conversation(authorization, request.previous_response_id)
        try:
            return responses_api.history_decoder.decode(items)
        except msgspec.ValidationError as exc:
            raise InvalidRequest(
                f"the stored response cannot be continued: {exc}", param="previous_response_id"
            ) from exc

    def _keeper(
        self, scope: Scope, request: ResponsesRequest, history: list[responses_api.InputItem]
    ) -> Callable[[dict[str, Any]], Awaitable[bool]] | None:
        """What stores the response (``store``, true unless the request says false, as OpenAI's default):
        the control plane, for the request's key; None where there is none to store it with."""
        authorization = header(scope, b"authorization")
        control_plane = self.control_plane
        if request.store is False or control_plane is None or scope.get(_API_KEY) is None or authorization is None:
            return None
        given = responses_api.input_items(request)

        async def keep(body: dict[str, Any]) -> bool:
            conversation = responses_api.conversation_items(history, request, body["output"])
            return await control_plane.store_response(authorization, body, given, conversation)

        return keep

    async def _respond(
        self,
        kind: encoding.Kind,
        endpoint: str,
        model: ServedModel,
        request: SamplingFields,
        generation: Generation,
        receive: Receive,
        send: Send,
        builder: ResponseBuilder | None = None,
        batch: completion_batch.Batch | None = None,
        keep: Callable[[dict[str, Any]], Awaitable[bool]] | None = None,
    ) -> str:
        """Run the generation, streamed or whole, and stop it if the client goes away; returns how it ended
        ("success", "error" or "cancelled"). ``builder`` shapes it as a Responses API answer; a ``batch``
        (whose ``total`` is ``generation``) runs its prompts' generations instead."""
        stream, stream_options = request.stream, request.stream_options
        model_metrics: Any = self.metrics.for_model(model.name)
        if self.models.request_log is not None:  # its record carries the TTFT and ITL observed
            model_metrics = TimedMetrics(model_metrics, generation)
        model_metrics.inflight.inc()
        started = time.perf_counter()
        status = "error"
        watcher = DisconnectWatcher(receive, generation)
        if stream_options is not None and stream_options.include_usage and stream_options.continuous_usage_stats:
            send = with_usage_in_every_chunk(send, batch.tally if batch is not None else lambda: generation)
        try:
            nvext = request.nvext
            show_instance = bool(nvext is not None and nvext.annotations and "instance_id" in nvext.annotations)
            failure = None
            if batch is not None:
                failure = await batch.respond(
                    stream=stream,
                    include_usage=bool(stream_options is not None and stream_options.include_usage),
                    model=model.name,
                    headers=response_headers(SSE_HEADERS if stream else JSON_HEADERS, generation),
                    send=send,
                    first_piece=lambda: model_metrics.ttft.observe(time.perf_counter() - started),
                )
            elif builder is not None:
                failure = await respond_responses(builder, generation, stream, send, started, model_metrics, keep)
            elif stream:
                include_usage = bool(stream_options is not None and stream_options.include_usage)
                failure = await self._stream(
                    kind, model, generation, include_usage, show_instance, send, started, model_metrics
                )
            else:
                await self._whole(kind, model, generation, show_instance, send, started, model_metrics)
            if failure is None:
                status = "success"
            else:
                generation.error_type = failure.error_type
                self.metrics.error(failure.error_type, int(failure.status))
        except asyncio.CancelledError:
            if not watcher.disconnected:
                raise
            # The watcher cancelled us because the client left; the generation's finally has run.
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            status = "cancelled"
            log.debug("client disconnected; request %s cancelled", generation.request_id)
        finally:
            watcher.close()
            model_metrics.inflight.dec()
            model_metrics.finished(
                endpoint=endpoint,
                streaming=stream,
                status=status,
                duration=time.perf_counter() - started,
                prompt_tokens=generation.prompt_tokens,
                completion_tokens=generation.completion_tokens,
            )
        return status

    async def _whole(
        self,
        kind: encoding.Kind,
        model: ServedModel,
        generation: Generation,
        show_instance: bool,
        send: Send,
        started: float,
        metrics: Any,
    ) -> None:
        pieces: list[str] = []
        # aclosing: whatever ends this (a cancellation included), the pipeline is closed now, and
        # with it the engine's stream (a remote one then tells its worker to stop), not by the GC.
        async with contextlib.aclosing(generation):
            async for piece in generation.pieces():
                if not pieces:
                    metrics.ttft.observe(time.perf_counter() - started)
                pieces.append(piece)
        text = "".join(pieces)
        finish_reason: str | None = generation.finish_reason
        message = None
        if (parser := generation.output) is not None:
            parsed = parser.feed(text).extend(parser.flush())
            parser.check_required(generation.finish_reason)
            text = parsed.content
            reasoning = parsed.reasoning if parser.has_reasoning else None
            message = encoding.chat_message(text, reasoning=reasoning, tool_calls=parser.calls)
            finish_reason = parser.finish_reason(finish_reason)
        logprobs = None
        if generation.logprobs is not None:
            if kind == "chat":
                logprobs = chat_logprobs(generation.logprobs)
            else:
                logprobs = CompletionLogprobs().shape(generation.logprobs)
        body = encoding.full_response(
            kind,
            response_id=response_id(kind, generation),
            created=int(time.time()),
            model=model.name,
            text=text,
            finish_reason=finish_reason,
            prompt_tokens=generation.prompt_tokens,
            completion_tokens=generation.completion_tokens,
            cached_tokens=generation.cached_tokens,
            reasoning_tokens=generation.reasoning_tokens,
            nvext=nvext(generation) if show_instance else None,
            message=message,
            logprobs=logprobs,
        )
        headers = response_headers(JSON_HEADERS, generation)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _stream(
        self,
        kind: encoding.Kind,
        model: ServedModel,
        generation: Generation,
        include_usage: bool,
        show_instance: bool,
        send: Send,
        started: float,
        metrics: Any,
    ) -> GatewayError | None:
        """Stream the generation as SSE; returns the failure that ended it early, if one did.

        A failure before the first piece propagates (the client gets a proper error status). After
        the status line, any exception ends the stream with an OpenAI error event and ``[DONE]``,
        and no finish chunk: the answer did not finish.
        """
        encoder = encoding.StreamEncoder(
            kind, response_id=response_id(kind, generation), created=int(time.time()), model=model.name
        )
        # aclosing: see _whole; here a cancellation may also land inside a send to a slow client.
        async with contextlib.aclosing(generation):
            pieces = generation.pieces()
            # Pull the first piece before sending the status line, so that an engine that fails at
            # once still gets a proper error status instead of a broken stream.
            first = await anext(pieces, None)
            headers = response_headers(SSE_HEADERS, generation)
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            opening = encoder.first()
            if opening is not None:
                await send({"type": "http.response.body", "body": opening, "more_body": True})
            rich = generation.output is not None or generation.logprobs is not None
            parsed = RichFrames(kind, encoder, generation) if rich else None
            if first is not None:
                first_at = time.perf_counter()
                metrics.ttft.observe(first_at - started)
                try:
                    if parsed is None:
                        await send({"type": "http.response.body", "body": encoder.piece(first), "more_body": True})
                        async for piece in pieces:
                            frame = encoder.piece(piece)
                            await send({"type": "http.response.body", "body": frame, "more_body": True})
                    else:
                        await parsed.send(send, first)
                        async for piece in pieces:
                            await parsed.send(send, piece)
                except Exception as exc:
                    failure = as_gateway_error(exc, generation)
                    frame = encoding.error_frame(failure.message, failure.error_type, failure.code)
                    await send({"type": "http.response.body", "body": frame + encoding.DONE_FRAME})
                    return failure
                # One observation per request, not per token: the mean time between tokens after
                # the first (what benchmarks call ITL or TPOT).
                if generation.completion_tokens > 1:
                    tokens_after_first = generation.completion_tokens - 1
                    metrics.inter_token_latency.observe((time.perf_counter() - first_at) / tokens_after_first)
        finish_reason: str | None = generation.finish_reason
        if parsed is not None:
            try:
                await parsed.finish(send)
            except GatewayError as exc:  # ToolCallMissing: the answer lacks the call asked for
                failure = as_gateway_error(exc, generation)
                frame = encoding.error_frame(failure.message, failure.error_type, failure.code)
                await send({"type": "http.response.body", "body": frame + encoding.DONE_FRAME})
                return failure
            finish_reason = parsed.finish_reason(finish_reason)
        tail = encoder.finish(finish_reason, nvext(generation) if show_instance else None)
        if include_usage:
            tail += encoder.usage(
                generation.prompt_tokens,
                generation.completion_tokens,
                generation.cached_tokens,
                generation.reasoning_tokens,
            )
        await send({"type": "http.response.body", "body": tail + encoding.DONE_FRAME})
        return None


_MODEL_PREFIX = "/v1/models/"
#: Paths outside /v1/ that an API key guards as it guards /v1/ (vLLM's own, and Cohere's v2 rerank).
_KEYED_WITHOUT_V1 = frozenset({"/tokenize", "/detokenize", "/score", "/rerank", "/v2/rerank"})


def _model_object(model: ServedModel) -> dict[str, Any]:
    """OpenAI's model object, with vLLM's ``max_model_len`` where the context is known and its ``parent`` (the
    base model) for a LoRA adapter."""
    body: dict[str, Any] = {"id": model.name, "object": "model", "created": model.created, "owned_by": "flotilla"}
    if model.context_length:
        body["max_model_len"] = model.context_length
    if (parent := getattr(model, "parent", None)) is not None:
        body["parent"] = parent
    return body


def _with_limit_headers(send: Send, meter: Meter, key: KeyRecord) -> Send:
    """``send`` that adds the key's ``x-ratelimit-*`` headers (as its counts stand then) to every answer, as
    OpenAI's do, so that a client can pace itself before it meets a 429 (whose headers say the same)."""

    async def send_with_limits(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            if not any(name.startswith(b"x-ratelimit-") for name, _ in headers):
                message = {**message, "headers": [*headers, *meter.limit_headers(key)]}
        await send(message)

    return send_with_limits


#: ``x-flotilla-disagg``: where this request's prompt is computed, whatever the ingress's --disagg-policy says.
DISAGG_HEADER = b"x-flotilla-disagg"
_DISAGG_VALUES = {b"local": "local", b"remote": "remote"}


def _disagg_override(scope: Scope) -> str | None:
    """The request's ``x-flotilla-disagg`` header: "local" (on its decode worker), "remote" (on a prefill worker
    when one is routable and not busy), or None. Raises InvalidRequest for another value."""
    value = header(scope, DISAGG_HEADER)
    if value is None:
        return None
    if (override := _DISAGG_VALUES.get(value.strip().lower())) is None:
        shown = value[:40].decode("latin-1")
        raise InvalidRequest(f"x-flotilla-disagg must be local or remote, not {shown!r}")
    return override


def _ended_by(scope: Scope) -> str:
    """The request log's error kind of a request answered without a GatewayError: "" (a success), the error
    type of a failure after its answer began, or "cancelled" (its client left)."""
    ended = scope.get(_STATUS)
    if ended == "cancelled":
        return "cancelled"
    if ended == "error":
        generation: Generation | None = scope.get(_GENERATION)
        return (generation.error_type if generation is not None else None) or "error"
    return ""
