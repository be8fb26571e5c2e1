"""``in=dyn://ns.comp.ep``: serve an engine as a networked worker instance.

The engine's typed wire structs (runtime/protocol.py) travel as msgpack: token engines take a
``PreprocessedRequest`` and answer ``EngineOutput`` items; text engines take a ``TextRequest`` and
answer ``TextOutput`` items. A token engine that embeds (llama.cpp) also takes ``EmbedRequest``s on its
instance's embed subject and answers ``EmbedOutput`` items.
"""

import asyncio
import functools
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from launcher.adapters import AdapterManager
from launcher.metrics_server import serve_metrics
from launcher.startup import connect_runtime
from runtime.cluster.addressing import EndpointAddress
from runtime.distributed import DistributedRuntime
from runtime.endpoint import Endpoint, deregister_adapter, drain_grace_seconds, register_model
from runtime.engine import Embedder, Engine, RequestContext
from runtime.errors import ConfigError
from runtime.fleet_contract.engine_names import LORA_ENGINES
from runtime.fleet_contract.router_settings import PipelineRouter
from runtime.kv.events import KvEventSource
from runtime.kv.phases import PhaseCounters
from runtime.kv.phases import now as phase_clock
from runtime.lora import LoraAdapter, LoraEngine, LoraInfo, lora_id
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


def _check_adapters(engine: Engine, base: str, loras: tuple[LoraAdapter, ...]) -> None:
    """Raise ConfigError for adapters given to an engine that takes none, more ``--lora`` ones than it holds, or
    one named as the base model: before the worker waits for etcd and NATS, so that a misconfiguration exits 2
    at once."""
    if not isinstance(engine, LoraEngine):
        raise ConfigError(f"this engine does not load LoRA adapters; engines that do: {', '.join(LORA_ENGINES)}")
    if len(loras) > engine.max_loras:
        raise ConfigError(
            f"--lora gives {len(loras)} adapters; the engine holds {engine.max_loras} at most (max_loras)"
        )
    for adapter in loras:
        if adapter.name == base:
            raise ConfigError(f"--lora {adapter.name}=...: the adapter needs a name of its own, not the base model's")


async def _serve_adapters(
    runtime: DistributedRuntime,
    endpoint: Endpoint,
    engine: Engine,
    base: str,
    registration: Callable[..., Awaitable[ModelCard]],
    loras: tuple[LoraAdapter, ...],
    lora_file: Path | None,
) -> None:
    """Load the adapters and register each beside ``base``; watch ``lora_file`` in a task the runtime owns (its
    death stops the worker). Raises ConfigError for an engine that takes no adapters, or a ``--lora`` one that
    cannot be served."""
    assert isinstance(engine, LoraEngine)  # _check_adapters() said so, before the worker connected

    async def publish(adapter: LoraAdapter) -> None:
        await registration(lora=LoraInfo(name=adapter.name, id=lora_id(adapter.name), base=base))

    async def withdraw(name: str) -> None:
        await deregister_adapter(endpoint, name)

    manager = AdapterManager(engine, fixed=loras, file=lora_file, publish=publish, withdraw=withdraw)
    await manager.start()
    if lora_file is not None:
        runtime.own(manager.watch, name=f"LoRA adapter file {lora_file}")


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
    loras: tuple[LoraAdapter, ...] = (),
    lora_file: Path | None = None,
) -> None:
    """Register ``card`` on ``address`` and answer requests with ``engine`` until SIGINT/SIGTERM.

    ``labels`` go into the instance's etcd registration (``--labels``); ``router`` (the ``--router-*`` flags
    given to a worker) into its model's, for gateways to route it so; ``role`` (``--disagg-role``) too, so
    that gateways send it only its part of requests. With ``metrics_port``, the worker's
    own metrics (launcher/worker_metrics.py) are served at ``http://metrics_host:metrics_port/metrics``.
    Raises ConfigError when that port cannot be listened on.

    ``loras`` (``--lora``) and the adapters of ``lora_file`` (``--lora-file``, watched) are loaded on the engine
    and registered as models of their own (launcher/adapters.py). Raises ConfigError for adapters given to an
    engine that takes none, or ``--lora`` adapters it cannot load.

    Raises BackgroundTaskFailed when a task the worker needs failed and stopped it.
    On the signal the worker drains: it deregisters and refuses new requests at once, lets those in
    flight finish for ``FLOTILLA_DRAIN_S`` seconds, and cuts the rest so that their ingress migrates them.
    """
    if loras or lora_file is not None:
        _check_adapters(engine, card.name, loras)
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
            registration = functools.partial(
                register_model, ModelType.TOKENS, endpoint, card=card, skip_special_tokens=engine.skip_special_tokens,
                router=router, embed_subject=embed_subject, role=role,
                prefill_token_capacity=getattr(engine, "prefill_token_capacity", None),
            )  # fmt: skip
        else:
            registration = functools.partial(register_model, ModelType.CHAT, endpoint, card=card, router=router)
        await registration()
        if loras or lora_file is not None:
            await _serve_adapters(runtime, endpoint, engine, card.name, registration, loras, lora_file)
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
