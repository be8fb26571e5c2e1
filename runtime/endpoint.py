"""The worker API: name an endpoint, serve it, register the model it serves.

``runtime.namespace("ns").component("backend").endpoint("generate")`` names an endpoint of this
process; ``endpoint.serve(handler)`` answers its requests (an async generator) and announces the
instance in etcd; ``register_model(...)`` announces the model it serves, so that gateways list it.

etcd holds, under the process's lease: ``flotilla/instances/<ns>/<comp>/<ep>/<id>`` (an
``InstanceEntry``: where to reach the instance) and ``flotilla/models/<ns>/<comp>/<ep>/<id>`` (a
``ModelEntry``: the model card; the tokenizer itself is in the object store).
"""

import inspect
import logging
import os
import re
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from runtime.cluster.addressing import EndpointAddress
from runtime.cluster.discovery import adapter_model_key, instance_key, model_key
from runtime.cluster.object_store import publish_tokenizer
from runtime.engine import RequestContext
from runtime.errors import ConfigError, ModelError
from runtime.fleet_contract.router_settings import PipelineRouter
from runtime.kv.events import KvEventSource
from runtime.kv.load_metrics import (
    LoadReports,
    active_requests_load,
    engine_load,
    publish_load_forever,
    waiting_requests,
)
from runtime.kv.phases import PhaseCounters
from runtime.kv.publisher import KvEventPublisher, start_kv_publishing
from runtime.lora import LoraInfo
from runtime.models.card import ModelCard, ModelType
from runtime.protocol import DisaggRole
from runtime.request_plane import EndpointServer, Handler
from runtime.settings import drain_grace_seconds as drain_grace_seconds  # re-exported for workers
from runtime.settings import max_request_bytes, max_waiting_requests, stream_ack_deadline_seconds

if TYPE_CHECKING:
    from runtime.distributed import DistributedRuntime

log = logging.getLogger(__name__)


# A label's key and value: no "," or "=" (they separate labels on the command line), nothing blank.
_LABEL_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_./-]{0,62}")
_LABEL_VALUE = re.compile(r"[A-Za-z0-9_./:@-]{0,253}")


class InstanceEntry(msgspec.Struct, kw_only=True):
    """Where an instance listens, and which process it is (for operators and the node agent)."""

    instance_id: int
    subject: str
    hostname: str
    pid: int
    #: Whose instance this is, set by whoever started it (the agent: pipeline, group, replica, node, instance).
    labels: dict[str, str] = {}


def parse_labels(text: str) -> dict[str, str]:
    """``k=v,k2=v2`` -> a dict; blank text is no labels. Raises ConfigError naming the bad label."""
    labels: dict[str, str] = {}
    if not text.strip():
        return labels
    for item in (part.strip() for part in text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"label {item!r} is not key=value")
        _check_label(key, value)
        if key in labels:
            raise ConfigError(f"label {key!r} is given twice")
        labels[key] = value
    return labels


def format_labels(labels: dict[str, str]) -> str:
    """The ``k=v,...`` text of ``labels``, as ``parse_labels`` reads it. Raises ConfigError for a bad label."""
    for key, value in labels.items():
        _check_label(key, value)
    return ",".join(f"{key}={value}" for key, value in labels.items())


def _check_label(key: str, value: str) -> None:
    if not _LABEL_KEY.fullmatch(key):
        raise ConfigError(f"label key {key!r} must be 1-63 letters, digits, '_', '.', '/' or '-'")
    if not _LABEL_VALUE.fullmatch(value):
        raise ConfigError(f"label {key}={value!r}: a value may hold only letters, digits, '_', '.', '/', ':', '@', '-'")


class ModelEntry(msgspec.Struct, kw_only=True):
    """A model an instance serves: its card without the tokenizer, which is in the object store."""

    instance_id: int
    subject: str
    card: ModelCard
    tokenizer_sha256: str | None = None
    #: How the gateway should detokenize for this engine (echo_core shows special tokens).
    skip_special_tokens: bool = True
    user_data: dict[str, Any] | None = None
    #: How gateways route this model (``--router-*`` flags of the worker): None leaves it to the gateway.
    router: PipelineRouter | None = None
    #: Where the instance embeds text (``EmbedRequest``), if its engine does: None, it does not.
    embed_subject: str | None = None
    #: Whether its engine publishes KV events (runtime/kv/publisher.py). KV routers predict the cache of an
    #: instance that does not from their own decisions. (True when a registration does not say: older workers.)
    kv_events: bool = True
    #: The part of a request's life it serves (``--disagg-role``): a gateway sends prefill-only requests to
    #: "prefill" instances only, and KV handoffs to "decode" ones only. Older workers register none: aggregated.
    role: DisaggRole = "aggregated"
    #: Prompt tokens its engine computes in one step (vLLM's ``max_num_batched_tokens``, over its dp ranks),
    #: if it says: what a prefill worker's in-flight prompt tokens are measured against (``--disagg-policy
    #: load``). None: unknown, and such a worker never counts as busy with prefills.
    prefill_token_capacity: int | None = None
    #: Set on the entry of a LoRA adapter the instance serves beside its base model (runtime/lora.py): its
    #: card is the base model's under the adapter's name. None: the base model.
    lora: LoraInfo | None = None


class Namespace:
    """A namespace of this process: usually one pipeline (one model)."""

    def __init__(self, runtime: "DistributedRuntime", name: str) -> None:
        self.runtime = runtime
        self.name = name

    def component(self, name: str) -> "Component":
        return Component(self, name)


class Component:
    """A service within a namespace (backend, prefill, decode)."""

    def __init__(self, namespace: Namespace, name: str) -> None:
        self.namespace = namespace
        self.name = name

    def endpoint(self, name: str) -> "Endpoint":
        return Endpoint(self.namespace.runtime, EndpointAddress(self.namespace.name, self.name, name))


class Endpoint:
    """One endpoint of this process: serve it, register a model on it."""

    def __init__(self, runtime: "DistributedRuntime", address: EndpointAddress) -> None:
        self.runtime = runtime
        self.address = address
        self.subject = address.subject(runtime.instance_id)
        self._server: EndpointServer | None = None
        #: Whether this endpoint publishes its engine's KV events: known once it serves.
        self.publishes_kv_events: bool | None = None
        #: Once served: its KV event publisher (an engine that reports its cache), and its load reports.
        self.kv_publisher: KvEventPublisher | None = None
        self.load_reports: LoadReports | None = None
        # Models registered before serve(): announced once requests can be answered.
        self._pending_models: list[tuple[str, bytes]] = []

    async def serve_bytes(
        self,
        handler: Handler,
        *,
        kv_source: KvEventSource | None = None,
        labels: dict[str, str] | None = None,
        phases: PhaseCounters | None = None,
    ) -> None:
        """Start answering requests with a bytes-level handler and announce this instance in etcd.

        ``labels`` go into the instance's registration (``InstanceEntry.labels``): the node agent finds
        its workers by them.

        With ``kv_source`` (an engine that reports its KV cache), its KV events, cache state and
        per-rank load are published for KV routers (runtime/kv/publisher.py), from before the first request.
        ``phases`` (counted by ``handler``) go into the load reports: the worker's part in disaggregated serving.
        """
        runtime = self.runtime
        load_reports: LoadReports | None = None
        self.publishes_kv_events = kv_source is not None
        if kv_source is not None:
            self.kv_publisher = await start_kv_publishing(runtime, self.address, kv_source)
            load_reports = engine_load(runtime.instance_id, kv_source)
        server = EndpointServer(
            runtime.nc,
            self.subject,
            handler,
            heartbeat_interval=runtime.heartbeat_interval,
            max_request_bytes=max_request_bytes(),
            ack_deadline=stream_ack_deadline_seconds(),
            max_waiting=max_waiting_requests(),
            waiting=None if kv_source is None else waiting_requests(kv_source),
        )
        await server.start()
        self._server = server
        runtime._add_server(server)
        entry = InstanceEntry(
            instance_id=runtime.instance_id,
            subject=self.subject,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            labels=dict(labels or {}),
        )
        await runtime.discovery.register(instance_key(self.address, runtime.instance_id), msgspec.json.encode(entry))
        for key, value in self._pending_models:
            await runtime.discovery.register(key, value)
        self._pending_models.clear()
        subject = self.address.load_metrics_subject()
        reports = load_reports or active_requests_load(runtime.instance_id, lambda: server.active_requests)
        if phases is not None:
            reports = phases.reports(reports)
        self.load_reports = reports

        def publish_load() -> Coroutine[Any, Any, None]:
            return publish_load_forever(runtime.nc, subject, reports)

        # Restarted if it fails: the load it publishes is advisory, never a reason to stop serving.
        runtime.own(publish_load, name=f"load metrics {self.address}", restart=True)
        log.info("serving %s as instance %x", self.address, runtime.instance_id)

    @property
    def server(self) -> EndpointServer | None:
        """The request server, once ``serve_bytes`` started it."""
        return self._server

    async def serve_embeddings(self, handler: Handler) -> str:
        """Answer embedding requests with ``handler`` on this instance's embed subject, and return it.

        No instance is registered for it: it is a second door of the same instance, named in its model's
        registration (``register_model(embed_subject=...)``), and drained with the generation endpoint.
        """
        runtime = self.runtime
        server = EndpointServer(
            runtime.nc,
            self.address.embed_subject(runtime.instance_id),
            handler,
            heartbeat_interval=runtime.heartbeat_interval,
            max_request_bytes=max_request_bytes(),
            ack_deadline=stream_ack_deadline_seconds(),
            max_waiting=max_waiting_requests(),
        )
        await server.start()
        runtime._add_server(server)
        return server.subject

    async def announce(self, key: str, value: bytes) -> None:
        """Put ``key`` in etcd now if this endpoint already answers requests, else once it does."""
        if self._server is None:
            self._pending_models.append((key, value))
        else:
            await self.runtime.discovery.register(key, value)

    async def serve(
        self, handler: Callable[..., AsyncIterator[Any]], *, kv_source: KvEventSource | None = None
    ) -> None:
        """Serve a Python handler until the runtime shuts down.

        The handler is an async generator taking the request (plain dicts and lists, as sent) and,
        if it accepts a second argument, the RequestContext; each item it yields (dicts, lists,
        strings, numbers, or msgspec Structs) is sent back as one response. An engine that reports
        its KV cache passes itself as ``kv_source`` (see ``serve_bytes``).
        """
        wants_context = len(inspect.signature(handler).parameters) >= 2

        async def bytes_handler(payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
            request = msgspec.msgpack.decode(payload)
            outputs = handler(request, context) if wants_context else handler(request)
            async for output in outputs:
                yield msgspec.msgpack.encode(output)

        await self.serve_bytes(bytes_handler, kv_source=kv_source)
        await self.runtime.wait_for_shutdown()


async def register_model(
    model_type: ModelType | str,
    endpoint: Endpoint,
    model_path: str | Path | None = None,
    *,
    model_name: str | None = None,
    context_length: int | None = None,
    kv_cache_block_size: int | None = None,
    user_data: dict[str, Any] | None = None,
    card: ModelCard | None = None,
    skip_special_tokens: bool = True,
    router: PipelineRouter | None = None,
    embed_subject: str | None = None,
    role: DisaggRole = "aggregated",
    prefill_token_capacity: int | None = None,
    lora: LoraInfo | None = None,
) -> ModelCard:
    """Announce the model ``endpoint`` serves, so that gateways add it to ``/v1/models``.

    Token-level models need their tokenizer and chat template: from ``model_path`` (a GGUF file or a
    Hugging Face folder or repo) or a ready ``card``. Chat and completion models need only a name.
    ``router`` asks gateways to route the model so (its pipeline's settings); the first instance's wins.
    ``embed_subject`` is where the instance embeds text (``Endpoint.serve_embeddings``), if it does.
    ``role`` is the part of requests it serves when prefill and decode run on separate workers, and
    ``prefill_token_capacity`` the prompt tokens its engine computes in a step, if known.
    With ``lora``, the entry is of a LoRA adapter the instance serves beside its base model (``card``, renamed to
    the adapter's name), under its own key (``deregister_adapter`` withdraws it).
    Returns the card as registered. Raises ModelError / ConfigError on a bad model.
    """
    kind = ModelType(model_type)
    if card is None:
        if model_path is not None:
            from runtime.models.loading import load_model_card
            from runtime.models.source import resolve_model

            card = load_model_card(resolve_model(str(model_path)), name=model_name, context_length=context_length)
        elif kind is ModelType.TOKENS:
            raise ModelError("a token-level model needs model_path (its tokenizer and chat template)")
        elif model_name is None:
            raise ConfigError("register_model needs model_name or model_path")
        else:
            card = ModelCard(name=model_name, context_length=context_length or 0)
    card = card.replace(model_type=kind)
    if kv_cache_block_size is not None:
        card = card.replace(kv_cache_block_size=kv_cache_block_size)
    if lora is not None:
        card = card.replace(name=lora.name)
    runtime = endpoint.runtime
    digest = await publish_tokenizer(runtime.nc, card.tokenizer_json) if card.tokenizer_json else None
    entry = ModelEntry(
        instance_id=runtime.instance_id,
        subject=endpoint.subject,
        card=msgspec.structs.replace(card, tokenizer_json=None, source=None),
        tokenizer_sha256=digest,
        skip_special_tokens=skip_special_tokens,
        user_data=user_data,
        router=router,
        embed_subject=embed_subject,
        # Registered before serving, it is not known yet: routers take it that events come, as they did.
        kv_events=endpoint.publishes_kv_events is not False,
        role=role,
        prefill_token_capacity=prefill_token_capacity,
        lora=lora,
    )
    key = model_key(endpoint.address, runtime.instance_id)
    if lora is not None:
        key = adapter_model_key(endpoint.address, runtime.instance_id, lora.name)
    await endpoint.announce(key, msgspec.json.encode(entry))
    log.info("registered model %r (%s) on %s", card.name, kind.value, endpoint.address)
    return card


async def deregister_adapter(endpoint: Endpoint, name: str) -> None:
    """Withdraw LoRA adapter ``name``'s registration (``register_model(lora=...)``): gateways stop sending it
    requests. Raises DiscoveryUnavailable if etcd cannot be reached (the key is forgotten all the same: it goes
    with the lease)."""
    await endpoint.runtime.discovery.deregister(adapter_model_key(endpoint.address, endpoint.runtime.instance_id, name))
