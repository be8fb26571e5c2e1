"""``in=dyn://ns.comp.ep``: serve an engine as a networked worker instance.

The engine's typed wire structs (runtime/protocol.py) travel as msgpack: token engines take a
``PreprocessedRequest`` and answer ``EngineOutput`` items; text engines take a ``TextRequest`` and
answer ``TextOutput`` items. A token engine that embeds (llama.cpp) also takes ``EmbedRequest``s on its
instance's embed subject and answers ``EmbedOutput`` items.
"""

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from launcher.metrics_server import serve_metrics
from launcher.startup import connect_runtime
from runtime.cluster.addressing import EndpointAddress
from runtime.endpoint import drain_grace_seconds, register_model
from runtime.engine import Embedder, Engine, RequestContext
from runtime.fleet_contract.router_settings import PipelineRouter
from runtime.kv.events import KvEventSource
from runtime.kv.phases import PhaseCounters
from runtime.kv.phases import now as phase_clock
from runtime.models.card import ModelCard, ModelType
from runtime.protocol import (
    DisaggRole,
    EmbedOutput,
    EmbedRequest,
    EngineOutput,
    PreprocessedRequest,
    TextRequest,
    float32_bytes,
)
from runtime.request_plane import Handler

log = logging.getLogger(__name__)

_token_request = msgspec.msgpack.Decoder(PreprocessedRequest)
_text_request = msgspec.msgpack.Decoder(TextRequest)
_embed_request = msgspec.msgpack.Decoder(EmbedRequest)
#: The vector bytes one EmbedOutput carries at most: outputs stay well inside a NATS frame (1 MiB by default),
#: which the request plane fills with as many outputs as fit.
EMBED_OUTPUT_BYTES = 256 * 1024


def engine_handler(engine: Engine, phases: PhaseCounters | None = None) -> Handler:
    """A bytes-level request handler around ``engine``: decode its request type, encode its outputs; with
    ``phases``, count the prefill-only requests and the KV handoffs it serves, and how long each took."""
    encode = msgspec.msgpack.Encoder().encode
    decoder: msgspec.msgpack.Decoder[Any] = _token_request if engine.kind == "token" else _text_request
    generate: Callable[[Any, RequestContext], AsyncIterator[msgspec.Struct]] = engine.generate

    async def handler(payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
        request = decoder.decode(payload)
        if (
            phases is None
            or not isinstance(request, PreprocessedRequest)
            or not (request.prefill_only or request.handoff is not None)
        ):
            async for output in generate(request, context):
                yield encode(output)
            return
        started, first = phase_clock(), True
        async for output in generate(request, context):
            if first and request.handoff is not None:
                phases.took_handoff(phase_clock() - started)
            first = False
            if request.prefill_only and isinstance(output, EngineOutput) and output.handoff is not None:
                phases.prefilled(phase_clock() - started)
            yield encode(output)

    return handler


def embed_handler(embedder: Embedder) -> Handler:
    """A bytes-level handler for an instance's embed subject: an ``EmbedRequest`` in, ``EmbedOutput`` items out.

    The vectors are float32 bytes, as many per output as fit in ``EMBED_OUTPUT_BYTES``.
    """
    encode = msgspec.msgpack.Encoder().encode

    async def handler(payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
        request = _embed_request.decode(payload)
        vectors, tokens = await embedder.embed(request.texts)
        packed = [float32_bytes(vector) for vector in vectors]
        start = 0
        while start < len(packed):
            end, size = start, 0
            while end < len(packed) and (end == start or size + len(packed[end]) <= EMBED_OUTPUT_BYTES):
                size += len(packed[end])
                end += 1
            yield encode(EmbedOutput(start=start, vectors=packed[start:end], prompt_tokens=tokens if start == 0 else 0))
            start = end

    return handler


async def serve_worker(
    address: EndpointAddress,
    engine: Engine,
    card: ModelCard,
    *,
    labels: dict[str, str] | None = None,
    router: PipelineRouter | None = None,
    role: DisaggRole = "aggregated",
    metrics_host: str = "127.0.0.1",
    metrics_port: int | None = None,
) -> None:
    """Register ``card`` on ``address`` and answer requests with ``engine`` until SIGINT/SIGTERM.

    ``labels`` go into the instance's etcd registration (``--labels``); ``router`` (the ``--router-*`` flags
    given to a worker) into its model's, for gateways to route it so; ``role`` (``--disagg-role``) too, so
    that gateways send it only its part of requests. With ``metrics_port``, the worker's
    own metrics (launcher/worker_metrics.py) are served at ``http://metrics_host:metrics_port/metrics``.
    Raises ConfigError when that port cannot be listened on.

    Raises BackgroundTaskFailed when a task the worker needs failed and stopped it.
    On the signal the worker drains: it deregisters and refuses new requests at once, lets those in
    flight finish for ``FLOTILLA_DRAIN_S`` seconds, and cuts the rest so that their ingress migrates them.
    """
    runtime = await connect_runtime()
    if runtime is None:
        return  # stopped by SIGTERM before etcd and NATS answered
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, runtime.shutdown)
    metrics_server: asyncio.Server | None = None
    try:
        endpoint = runtime.endpoint(address)
        # An engine that reports its KV cache has its events, cache state and load published for KV routers.
        kv_source = engine if isinstance(engine, KvEventSource) else None
        phases = PhaseCounters() if engine.kind == "token" else None
        await endpoint.serve_bytes(engine_handler(engine, phases), kv_source=kv_source, labels=labels, phases=phases)
        if metrics_port is not None:
            # Imported here: prometheus_client (and the http.server, urllib and wsgiref it brings) costs
            # every worker start ~20 ms of CPU before it registers, and only --metrics-port uses it.
            from launcher.worker_metrics import WorkerMetrics

            metrics = WorkerMetrics.of(endpoint, engine)
            metrics_server = await serve_metrics(metrics_host, metrics_port, metrics.exposition)
        if engine.kind == "token":
            # An engine that embeds answers POST /v1/embeddings of its ingresses on a second subject.
            embed_subject = None
            if card.embeddings and isinstance(engine, Embedder):
                embed_subject = await endpoint.serve_embeddings(embed_handler(engine))
            await register_model(
                ModelType.TOKENS, endpoint, card=card, skip_special_tokens=engine.skip_special_tokens, router=router,
                embed_subject=embed_subject, role=role,
                prefill_token_capacity=getattr(engine, "prefill_token_capacity", None),
            )  # fmt: skip
        else:
            await register_model(ModelType.CHAT, endpoint, card=card, router=router)
        print(
            f"Flotilla worker {runtime.instance_id:x} (pid {os.getpid()}) serves {card.name!r} on {address}", flush=True
        )
        await runtime.wait_for_shutdown()
        log.info("shutting down worker %x", runtime.instance_id)
        await runtime.drain(drain_grace_seconds())
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        if metrics_server is not None:
            metrics_server.close()
        await runtime.close()
    runtime.raise_if_failed()  # an owned task that died stopped the worker: exit 1, so it is restarted
