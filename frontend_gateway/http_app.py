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
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec

from frontend_gateway.access.api_keys import KeyTable, check_model
from frontend_gateway.access.concurrency import KeyConcurrency
from frontend_gateway.access.quotas import UNKNOWN_MODEL, Meter, Reservation
from frontend_gateway.admission import Admission, AdmissionLimits
from frontend_gateway.errors import (
    EngineFailed,
    GatewayError,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    RequestTooLarge,
)
from frontend_gateway.metrics import GatewayMetrics
from frontend_gateway.models.pipeline import Generation, ModelRegistry, ServedModel
from frontend_gateway.models.served_names import ServedNames, not_ready
from frontend_gateway.openai_api import (
    completion_batch,
    embeddings,
    encoding,
    preprocessor,
    responses_api,
    scoring,
    unknown_fields,
)
from frontend_gateway.openai_api import tokenize as tokenization
from frontend_gateway.openai_api.chat_output import Delta
from frontend_gateway.openai_api.embeddings import EmbeddingRequest
from frontend_gateway.openai_api.logprobs import CompletionLogprobs, chat_logprobs
from frontend_gateway.openai_api.responses_api import ResponseBuilder, ResponsesRequest
from frontend_gateway.openai_api.types import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    chat_decoder,
    completion_decoder,
)
from frontend_gateway.slow_clients import DEFAULT_BODY_TIMEOUT_S, DEFAULT_SEND_TIMEOUT_S, SlowClients
from runtime.fleet_contract.api_keys import KeyRecord

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Lifespan = Callable[[], contextlib.AbstractAsyncContextManager[None]]

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024

_JSON_HEADERS = [(b"content-type", b"application/json")]
# Where a checked request's API key record rides in its ASGI scope, with what its usage is counted from:
# the model it named (when served), its generation, and how the generation ended.
_API_KEY = "flotilla.api_key"
_MODEL = "flotilla.model"
_GENERATION = "flotilla.generation"
_STATUS = "flotilla.status"
_EMBEDDED_TOKENS = "flotilla.embedded_tokens"  # an embeddings request's prompt tokens, for its key's usage
_RESERVATION = "flotilla.reservation"  # the tokens set aside for it against its key's token limits
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class ClientDisconnected(Exception):
    """The client went away before the response was complete."""


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
    ) -> None:
        self.models = models
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
        try:
            path = scope["path"].rstrip("/") or "/"
            route = self._routes.get(path)
            if route is None and path.startswith(_MODEL_PREFIX):
                route = ("GET", self._retrieve_model)
            if route is None:
                raise NotFound(f"no route for {scope['path']}; see /v1/models, /v1/chat/completions, /v1/completions")
            method, handler = route
            if scope["method"] != method and not (method == "GET" and scope["method"] == "HEAD"):
                raise MethodNotAllowed(f"{scope['path']} takes {method}, not {scope['method']}")
            counted: KeyRecord | None = None
            if self.api_keys is not None and (path.startswith("/v1/") or path in _KEYED_WITHOUT_V1):
                key = scope[_API_KEY] = self.api_keys.check(_header(scope, b"authorization"))
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
        except GatewayError as exc:
            self._count_usage(scope, failed=True)
            if exc.status >= 500 and exc.retry_after is None:  # refusals under load are counted, not logged
                log.warning("%s %s failed: %s (HTTP %d)", scope["method"], scope["path"], exc.message, exc.status)
            await self._send_error(send, exc)
        except ClientDisconnected:
            pass
        except Exception:
            log.exception("unexpected error serving %s", scope.get("path"))
            await self._send_error(send, GatewayError("internal error; see the server log"))
        finally:
            self._release(scope)

    async def _send_error(self, send: Send, exc: GatewayError) -> None:
        self.metrics.error(exc.error_type, int(exc.status))
        body = encoding.error_body(exc.message, exc.error_type, exc.code, exc.param)
        headers = _JSON_HEADERS
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
        await send({"type": "http.response.start", "status": status, "headers": _JSON_HEADERS})
        await send({"type": "http.response.body", "body": body})

    async def _list_models(self, scope: Scope, receive: Receive, send: Send) -> None:
        key: KeyRecord | None = scope.get(_API_KEY)
        data = [_model_object(model) for model in self.models.all() if key is None or key.allows_model(model.name)]
        await self._send_json(send, msgspec.json.encode({"object": "list", "data": data}))

    async def _retrieve_model(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /v1/models/{id}`` (the client's ``models.retrieve``); the id may hold slashes (``org/name``)."""
        model = await self._find_model(scope["path"].rstrip("/")[len(_MODEL_PREFIX) :], scope)
        await self._send_json(send, msgspec.json.encode(_model_object(model)))

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
        if key is None or self.meter is None or (generation is None and embedded is None and not failed):
            return  # a listing of models, say: usage counts generations, embeddings and failed requests
        reservation: Reservation | None = scope.get(_RESERVATION)
        if generation is None:
            model = scope.get(_MODEL, UNKNOWN_MODEL)
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
        leaving = asyncio.ensure_future(_wait_for_disconnect(receive))
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
        request: ChatCompletionRequest = _decode(chat_decoder, await self._read_body(scope, receive))
        preprocessor.check_chat(request)
        disagg = _disagg_override(scope)
        model = await self._find_model(request.model, scope)
        await self._charge(scope)
        await self._admit(receive)
        try:
            generation = await model.prepare_chat(request)
            self._reserve(scope, generation.token_bound)
            scope[_GENERATION] = generation
            generation.context.disagg = disagg
            scope[_STATUS] = await self._respond("chat", "chat_completions", model, request, generation, receive, send)
        finally:
            self.admission.release()

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        request: CompletionRequest = _decode(completion_decoder, await self._read_body(scope, receive))
        preprocessor.check_stream_options(request)
        prompts = completion_batch.prompts(request)
        disagg = _disagg_override(scope)
        model = await self._find_model(request.model, scope)
        await self._charge(scope)
        await self._admit(receive)
        try:
            if len(prompts) > 1:
                scope[_STATUS] = await self._completion_batch(scope, model, request, prompts, disagg, receive, send)
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
    ) -> str:
        """A completion request with several prompts (openai_api/completion_batch.py); returns how it ended."""
        batch = await completion_batch.prepare(model, request, prompts, disagg)
        self._reserve(scope, batch.total.token_bound)
        scope[_GENERATION] = batch.total
        return await self._respond("completion", "completions", model, request, batch.total, receive, send, batch=batch)

    async def _embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/embeddings``, for models whose engine embeds (openai_api/embeddings.py)."""
        request: EmbeddingRequest = _decode(embeddings.decoder, await self._read_body(scope, receive))
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
        request: scoring.ScoreRequest = _decode(scoring.score_decoder, await self._read_body(scope, receive))
        model = await self._find_model(request.model, scope)
        await self._answer_scores(scope, receive, send, scoring.Scoring(model, request))

    async def _rerank(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/rerank`` (and ``/rerank``, ``/v2/rerank``): documents ranked against a query (scoring.py)."""
        request: scoring.RerankRequest = _decode(scoring.rerank_decoder, await self._read_body(scope, receive))
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
        request: tokenization.TokenizeRequest = _decode(
            tokenization.tokenize_decoder, await self._read_body(scope, receive)
        )
        model = await self._find_model(request.model, scope)
        await self._charge(scope)
        await self._send_json(send, msgspec.json.encode(await tokenization.tokenize(model, request)))

    async def _detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/detokenize`` (and vLLM's ``/detokenize``): token ids as text."""
        request: tokenization.DetokenizeRequest = _decode(
            tokenization.detokenize_decoder, await self._read_body(scope, receive)
        )
        model = await self._find_model(request.model, scope)
        await self._charge(scope)
        await self._send_json(send, msgspec.json.encode(tokenization.detokenize(model, request)))

    async def _responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/responses``: the Responses API over the chat pipeline (openai_api/responses_api.py)."""
        request: ResponsesRequest = _decode(responses_api.decoder, await self._read_body(scope, receive))
        chat = responses_api.to_chat(request)
        preprocessor.check_chat(chat)
        disagg = _disagg_override(scope)
        model = await self._find_model(chat.model, scope)
        await self._charge(scope)
        await self._admit(receive)
        try:
            generation = await model.prepare_chat(chat)
            self._reserve(scope, generation.token_bound)
            scope[_GENERATION] = generation
            generation.context.disagg = disagg
            builder = ResponseBuilder(request, response_id=generation.request_id, model=model.name)
            scope[_STATUS] = await self._respond("chat", "responses", model, chat, generation, receive, send, builder)
        finally:
            self.admission.release()

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
    ) -> str:
        """Run the generation, streamed or whole, and stop it if the client goes away; returns how it ended
        ("success", "error" or "cancelled"). ``builder`` shapes it as a Responses API answer; a ``batch``
        (whose ``total`` is ``generation``) runs its prompts' generations instead."""
        stream, stream_options = request.stream, request.stream_options
        model_metrics = self.metrics.for_model(model.name)
        model_metrics.inflight.inc()
        started = time.perf_counter()
        status = "error"
        watcher = _DisconnectWatcher(receive, generation)
        try:
            nvext = request.nvext
            show_instance = bool(nvext is not None and nvext.annotations and "instance_id" in nvext.annotations)
            failure = None
            if batch is not None:
                failure = await batch.respond(
                    stream=stream,
                    include_usage=bool(stream_options is not None and stream_options.include_usage),
                    model=model.name,
                    headers=_response_headers(_SSE_HEADERS if stream else _JSON_HEADERS, generation),
                    send=send,
                    first_piece=lambda: model_metrics.ttft.observe(time.perf_counter() - started),
                )
            elif builder is not None:
                failure = await _respond_responses(builder, generation, stream, send, started, model_metrics)
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
            message = encoding.chat_message(text, reasoning=reasoning, tool_calls=parsed.tool_calls)
            finish_reason = parser.finish_reason(finish_reason)
        logprobs = None
        if generation.logprobs is not None:
            if kind == "chat":
                logprobs = chat_logprobs(generation.logprobs)
            else:
                logprobs = CompletionLogprobs().shape(generation.logprobs)
        body = encoding.full_response(
            kind,
            response_id=_response_id(kind, generation),
            created=int(time.time()),
            model=model.name,
            text=text,
            finish_reason=finish_reason,
            prompt_tokens=generation.prompt_tokens,
            completion_tokens=generation.completion_tokens,
            cached_tokens=generation.cached_tokens,
            nvext=_nvext(generation) if show_instance else None,
            message=message,
            logprobs=logprobs,
        )
        headers = _response_headers(_JSON_HEADERS, generation)
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
            kind, response_id=_response_id(kind, generation), created=int(time.time()), model=model.name
        )
        # aclosing: see _whole; here a cancellation may also land inside a send to a slow client.
        async with contextlib.aclosing(generation):
            pieces = generation.pieces()
            # Pull the first piece before sending the status line, so that an engine that fails at
            # once still gets a proper error status instead of a broken stream.
            first = await anext(pieces, None)
            headers = _response_headers(_SSE_HEADERS, generation)
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            opening = encoder.first()
            if opening is not None:
                await send({"type": "http.response.body", "body": opening, "more_body": True})
            rich = generation.output is not None or generation.logprobs is not None
            parsed = _RichFrames(kind, encoder, generation) if rich else None
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
                    failure = _as_gateway_error(exc, generation)
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
                failure = _as_gateway_error(exc, generation)
                frame = encoding.error_frame(failure.message, failure.error_type, failure.code)
                await send({"type": "http.response.body", "body": frame + encoding.DONE_FRAME})
                return failure
            finish_reason = parsed.finish_reason(finish_reason)
        tail = encoder.finish(finish_reason, _nvext(generation) if show_instance else None)
        if include_usage:
            tail += encoder.usage(generation.prompt_tokens, generation.completion_tokens, generation.cached_tokens)
        await send({"type": "http.response.body", "body": tail + encoding.DONE_FRAME})
        return None


class _RichFrames:
    """The frames of a streamed answer that goes through its model's parsers (chat_output), or carries
    log probabilities: each frame a dict encoded whole, off the fast path of plain text pieces."""

    __slots__ = ("_completion_logprobs", "_encoder", "_generation", "_kind", "_next_index", "_parser")

    def __init__(self, kind: encoding.Kind, encoder: encoding.StreamEncoder, generation: Generation) -> None:
        self._kind = kind
        self._encoder = encoder
        self._generation = generation
        self._parser = generation.output
        self._completion_logprobs = CompletionLogprobs()
        self._next_index = 0  # of the next tool call: a stream numbers them

    async def send(self, send: Send, piece: str) -> None:
        await self._send(send, self._parser.feed(piece) if self._parser is not None else Delta(content=piece))

    async def finish(self, send: Send) -> None:
        """Send what the parsers held back; raises ToolCallMissing if a required call never came."""
        if self._parser is not None:
            await self._send(send, self._parser.flush())
            self._parser.check_required(self._generation.finish_reason)
        await self._send(send, Delta())  # log probabilities of tokens whose text was held back or cut

    def finish_reason(self, reason: str | None) -> str | None:
        return self._parser.finish_reason(reason) if self._parser is not None else reason

    async def _send(self, send: Send, delta: Delta) -> None:
        entries = self._generation.take_logprobs()
        if not delta and not entries:
            return  # held back: part of a tag, or a call not yet complete
        calls = []
        for call in delta.tool_calls:
            calls.append(call.as_openai(self._next_index))
            self._next_index += 1
        logprobs = None
        if self._generation.logprobs is not None:
            chat = self._kind == "chat"
            logprobs = chat_logprobs(entries) if chat else self._completion_logprobs.shape(entries)
        frame = self._encoder.delta(delta.reasoning, delta.content, calls, logprobs)
        await send({"type": "http.response.body", "body": frame, "more_body": True})


async def _respond_responses(
    builder: ResponseBuilder, generation: Generation, stream: bool, send: Send, started: float, metrics: Any
) -> GatewayError | None:
    """Send a Responses API answer, whole or as its events; returns the failure that ended a stream.

    As for chat, a failure before the first piece propagates (a proper error status) and one after
    the status line ends the stream with an ``error`` event.
    """
    parser = generation.output
    parsed = Delta()
    async with contextlib.aclosing(generation):
        pieces = generation.pieces()
        first = await anext(pieces, None)
        if first is not None:
            metrics.ttft.observe(time.perf_counter() - started)
        if not stream:
            text = "".join([first or "", *[piece async for piece in pieces]])
            parsed.content = text
            if parser is not None:
                parsed = parser.feed(text).extend(parser.flush())
                parser.check_required(generation.finish_reason)
        else:
            headers = _response_headers(_SSE_HEADERS, generation)
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": builder.start(), "more_body": True})
            try:
                piece = first
                while piece is not None:
                    delta = parser.feed(piece) if parser is not None else Delta(content=piece)
                    if delta:
                        await send({"type": "http.response.body", "body": builder.delta(delta), "more_body": True})
                    piece = await anext(pieces, None)
                if parser is not None:
                    if delta := parser.flush():
                        await send({"type": "http.response.body", "body": builder.delta(delta), "more_body": True})
                    parser.check_required(generation.finish_reason)
            except Exception as exc:
                failure = _as_gateway_error(exc, generation)
                await send({"type": "http.response.body", "body": builder.error(failure.message, failure.code)})
                return failure
    finish_reason = parser.finish_reason(generation.finish_reason) if parser else generation.finish_reason
    usage = builder.usage(generation.prompt_tokens, generation.completion_tokens, generation.cached_tokens)
    if stream:
        await send({"type": "http.response.body", "body": builder.finish(finish_reason=finish_reason, usage=usage)})
    else:
        body = builder.whole(parsed, finish_reason=finish_reason, usage=usage)
        headers = _response_headers(_JSON_HEADERS, generation)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    return None


def _as_gateway_error(exc: Exception, generation: Generation) -> GatewayError:
    """The error to report for a failure mid-stream, logged here (nothing else will see it)."""
    generation.finish_reason = "error"
    if isinstance(exc, GatewayError):
        log.warning("request %s failed mid-stream: %s", generation.request_id, exc.message)
        return exc
    log.error("request %s failed mid-stream", generation.request_id, exc_info=exc)
    return EngineFailed("internal error while generating; see the server log")


class _DisconnectWatcher:
    """Waits for ``http.disconnect``; when it comes first, stops the generation and cancels us."""

    __slots__ = ("_generation", "_owner", "_task", "disconnected")

    def __init__(self, receive: Receive, generation: Generation) -> None:
        self.disconnected = False
        self._generation = generation
        self._owner = asyncio.current_task()
        self._task = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        if not await _wait_for_disconnect(receive):
            return  # closed: the answer is over
        self.disconnected = True
        self._generation.context.stop()
        if self._owner is not None:
            self._owner.cancel()

    def close(self) -> None:
        self._task.cancel()


async def _wait_for_disconnect(receive: Receive) -> bool:
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


_MODEL_PREFIX = "/v1/models/"
#: Paths outside /v1/ that an API key guards as it guards /v1/ (vLLM's own, and Cohere's v2 rerank).
_KEYED_WITHOUT_V1 = frozenset({"/tokenize", "/detokenize", "/score", "/rerank", "/v2/rerank"})


def _model_object(model: ServedModel) -> dict[str, Any]:
    """OpenAI's model object, with vLLM's ``max_model_len`` where the context is known."""
    body: dict[str, Any] = {"id": model.name, "object": "model", "created": model.created, "owned_by": "flotilla"}
    if model.context_length:
        body["max_model_len"] = model.context_length
    return body


def _decode(decoder: "msgspec.json.Decoder[Any]", body: bytes) -> Any:
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


def _response_headers(base: list[tuple[bytes, bytes]], generation: Generation) -> list[tuple[bytes, bytes]]:
    headers = [*base, (b"x-request-id", generation.request_id.encode())]
    if generation.context.served_by is not None:
        headers.append((b"x-flotilla-instance", generation.context.served_by.encode()))
    if generation.context.prefilled_by is not None:
        headers.append((b"x-flotilla-prefill-instance", generation.context.prefilled_by.encode()))
    return headers


def _nvext(generation: Generation) -> dict[str, Any]:
    return {"instance_id": generation.context.served_by}


def _response_id(kind: encoding.Kind, generation: Generation) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + generation.request_id


#: ``x-flotilla-disagg``: where this request's prompt is computed, whatever the ingress's --disagg-policy says.
DISAGG_HEADER = b"x-flotilla-disagg"
_DISAGG_VALUES = {b"local": "local", b"remote": "remote"}


def _disagg_override(scope: Scope) -> str | None:
    """The request's ``x-flotilla-disagg`` header: "local" (on its decode worker), "remote" (on a prefill worker
    when one is routable and not busy), or None. Raises InvalidRequest for another value."""
    value = _header(scope, DISAGG_HEADER)
    if value is None:
        return None
    if (override := _DISAGG_VALUES.get(value.strip().lower())) is None:
        shown = value[:40].decode("latin-1")
        raise InvalidRequest(f"x-flotilla-disagg must be local or remote, not {shown!r}")
    return override


def _header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case, as ASGI gives them), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None
