"""The distributed runtime: one process's connections to etcd and NATS, and the worker API.

A worker gets a ``DistributedRuntime``, names an endpoint with
``runtime.namespace("ns").component("backend").endpoint("generate")``, registers the model it
serves with ``register_model(...)`` and answers requests with ``endpoint.serve(handler)``, where the
handler is an async generator. Built-in engines use the same path with typed payloads
(``serve_bytes``). The gateway side uses ``models()`` to watch what workers register.

etcd holds, under this process's lease: ``flotilla/instances/<ns>/<comp>/<ep>/<id>`` (where to reach
an instance) and ``flotilla/models/<ns>/<comp>/<ep>/<id>`` (the model card). A tokenizer can be larger
than an etcd value may be, so it travels through the NATS JetStream object store, named by its hash.
"""

import asyncio
import contextlib
import hashlib
import inspect
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS

from runtime.addressing import EndpointAddress, new_instance_id
from runtime.config import env_float, env_int, env_str
from runtime.discovery import Discovery, instance_key, model_key
from runtime.engine import RequestContext
from runtime.errors import ConfigError, ModelError
from runtime.model_card import ModelCard, ModelType
from runtime.request_plane import (
    DEFAULT_MAX_REQUEST_BYTES,
    EndpointServer,
    Handler,
    RequestClient,
    connect_nats,
)

log = logging.getLogger(__name__)

TOKENIZER_BUCKET = "flotilla-tokenizers"
LOAD_METRICS_INTERVAL = 1.0


class InstanceEntry(msgspec.Struct, kw_only=True):
    """Where an instance listens, and which process it is (for operators)."""

    instance_id: int
    subject: str
    hostname: str
    pid: int


class ModelEntry(msgspec.Struct, kw_only=True):
    """A model an instance serves: its card without the tokenizer, which is in the object store."""

    instance_id: int
    subject: str
    card: ModelCard
    tokenizer_sha256: str | None = None
    #: How the gateway should detokenize for this engine (echo_core shows special tokens).
    skip_special_tokens: bool = True
    user_data: dict[str, Any] | None = None


class LoadMetrics(msgspec.Struct, kw_only=True):
    """What an instance publishes about its load, every second."""

    instance_id: int
    active_requests: int
    kv_usage: float | None = None


class DistributedRuntime:
    """Owns the NATS connection, the etcd lease and everything served through them."""

    def __init__(self, nc: NATS, discovery: Discovery, *, heartbeat_interval: float) -> None:
        self.nc = nc
        self.discovery = discovery
        self.instance_id = new_instance_id()
        self.heartbeat_interval = heartbeat_interval
        self._servers: list[EndpointServer] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._client: RequestClient | None = None
        self._shutdown = asyncio.Event()

    @classmethod
    async def connect(
        cls, *, nats_url: str | None = None, etcd_endpoints: list[str] | None = None, lease_ttl: float | None = None
    ) -> "DistributedRuntime":
        """Connect to NATS (``NATS_SERVER``) and etcd (``ETCD_ENDPOINTS``).

        Raises RequestPlaneUnavailable / DiscoveryUnavailable with what to do when one is down.
        """
        url = nats_url or env_str("NATS_SERVER", "nats://127.0.0.1:4222") or ""
        heartbeat = env_float("FLOTILLA_STREAM_HEARTBEAT_S", 1.0, minimum=0.05)
        nc = await connect_nats(url, name=f"flotilla-{socket.gethostname()}-{os.getpid()}")
        try:
            discovery = await Discovery.connect(etcd_endpoints, lease_ttl=lease_ttl)
        except BaseException:
            await nc.close()
            raise
        return cls(nc, discovery, heartbeat_interval=heartbeat)

    def namespace(self, name: str) -> "Namespace":
        return Namespace(self, name)

    def endpoint(self, address: EndpointAddress) -> "Endpoint":
        return Endpoint(self, address)

    async def client(self) -> RequestClient:
        """The request client for calling instances (started on first use)."""
        if self._client is None:
            silence = env_float("FLOTILLA_STREAM_SILENCE_S", 5.0, minimum=0.1)
            self._client = RequestClient(self.nc, silence_timeout=silence)
            await self._client.start()
        return self._client

    def shutdown(self) -> None:
        """Ask everything waiting on ``wait_for_shutdown`` to finish (safe from signal handlers)."""
        self._shutdown.set()

    async def wait_for_shutdown(self) -> None:
        await self._shutdown.wait()

    def own(self, task: asyncio.Task[None]) -> None:
        """Keep a background task, to be cancelled on close."""
        self._tasks.append(task)

    async def close(self) -> None:
        """Deregister at once (revoke the lease), stop serving, drain NATS."""
        self._shutdown.set()
        with contextlib.suppress(Exception):
            await self.discovery.close()
        for server in self._servers:
            await server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.close()
        with contextlib.suppress(Exception):
            await self.nc.drain()

    async def publish_tokenizer(self, tokenizer_json: str) -> str:
        """Put a tokenizer in the object store (once per content); return its sha256 name."""
        data = tokenizer_json.encode()
        digest = hashlib.sha256(data).hexdigest()
        store = await self._object_store()
        try:
            await store.get_info(digest)
        except nats.js.errors.ObjectNotFoundError:
            await store.put(digest, data)
        return digest

    async def fetch_tokenizer(self, digest: str) -> str:
        """The tokenizer JSON named ``digest``. Raises ModelError if it is not in the store."""
        store = await self._object_store()
        try:
            result = await store.get(digest)
        except nats.js.errors.NotFoundError as exc:
            raise ModelError(f"tokenizer {digest[:12]} is not in the object store") from exc
        data: bytes | None = result.data
        if data is None:
            raise ModelError(f"tokenizer {digest[:12]} is empty in the object store")
        return data.decode()

    async def _object_store(self) -> Any:
        js = self.nc.jetstream()
        try:
            return await js.object_store(TOKENIZER_BUCKET)
        except nats.js.errors.BucketNotFoundError:
            try:
                return await js.create_object_store(TOKENIZER_BUCKET)
            except nats.js.errors.Error:
                return await js.object_store(TOKENIZER_BUCKET)  # created by another process meanwhile
        except nats.errors.NoRespondersError as exc:
            raise ConfigError("NATS has no JetStream: start nats-server with -js (`make services` does)") from exc

    def _add_server(self, server: EndpointServer) -> None:
        self._servers.append(server)


class Namespace:
    def __init__(self, runtime: DistributedRuntime, name: str) -> None:
        self.runtime = runtime
        self.name = name

    def component(self, name: str) -> "Component":
        return Component(self, name)


class Component:
    def __init__(self, namespace: Namespace, name: str) -> None:
        self.namespace = namespace
        self.name = name

    def endpoint(self, name: str) -> "Endpoint":
        return Endpoint(self.namespace.runtime, EndpointAddress(self.namespace.name, self.name, name))


class Endpoint:
    """One endpoint of this process: serve it, register a model on it."""

    def __init__(self, runtime: DistributedRuntime, address: EndpointAddress) -> None:
        self.runtime = runtime
        self.address = address
        self.subject = address.subject(runtime.instance_id)
        self._server: EndpointServer | None = None
        # Models registered before serve(): announced once requests can be answered.
        self._pending_models: list[tuple[str, bytes]] = []

    async def serve_bytes(self, handler: Handler) -> None:
        """Start answering requests with a bytes-level handler and announce this instance in etcd."""
        runtime = self.runtime
        server = EndpointServer(
            runtime.nc,
            self.subject,
            handler,
            heartbeat_interval=runtime.heartbeat_interval,
            max_request_bytes=env_int("FLOTILLA_MAX_REQUEST_BYTES", DEFAULT_MAX_REQUEST_BYTES, minimum=1024),
        )
        await server.start()
        self._server = server
        runtime._add_server(server)
        entry = InstanceEntry(
            instance_id=runtime.instance_id, subject=self.subject, hostname=socket.gethostname(), pid=os.getpid()
        )
        await runtime.discovery.register(instance_key(self.address, runtime.instance_id), msgspec.json.encode(entry))
        for key, value in self._pending_models:
            await runtime.discovery.register(key, value)
        self._pending_models.clear()
        runtime.own(asyncio.create_task(self._publish_load(server), name=f"load metrics {self.address}"))
        log.info("serving %s as instance %x", self.address, runtime.instance_id)

    async def announce(self, key: str, value: bytes) -> None:
        """Put ``key`` in etcd now if this endpoint already answers requests, else once it does."""
        if self._server is None:
            self._pending_models.append((key, value))
        else:
            await self.runtime.discovery.register(key, value)

    async def serve(self, handler: Callable[..., AsyncIterator[Any]]) -> None:
        """Serve a Python handler until the runtime shuts down.

        The handler is an async generator taking the request (plain dicts and lists, as sent) and,
        if it accepts a second argument, the RequestContext; each item it yields (dicts, lists,
        strings, numbers, or msgspec Structs) is sent back as one response.
        """
        wants_context = len(inspect.signature(handler).parameters) >= 2

        async def bytes_handler(payload: bytes, context: RequestContext) -> AsyncIterator[bytes]:
            request = msgspec.msgpack.decode(payload)
            outputs = handler(request, context) if wants_context else handler(request)
            async for output in outputs:
                yield msgspec.msgpack.encode(output)

        await self.serve_bytes(bytes_handler)
        await self.runtime.wait_for_shutdown()

    async def _publish_load(self, server: EndpointServer) -> None:
        subject = self.address.load_metrics_subject()
        while True:
            await asyncio.sleep(LOAD_METRICS_INTERVAL)
            metrics = LoadMetrics(instance_id=self.runtime.instance_id, active_requests=server.active_requests)
            with contextlib.suppress(nats.errors.Error):
                await self.runtime.nc.publish(subject, msgspec.json.encode(metrics))


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
) -> ModelCard:
    """Announce the model ``endpoint`` serves, so that gateways add it to ``/v1/models``.

    Token-level models need their tokenizer and chat template: from ``model_path`` (a GGUF file or a
    Hugging Face folder or repo) or a ready ``card``. Chat and completion models need only a name.
    Returns the card as registered. Raises ModelError / ConfigError on a bad model.
    """
    kind = ModelType(model_type)
    if card is None:
        if model_path is not None:
            from runtime.model_loading import load_model_card
            from runtime.model_source import resolve_model

            card = load_model_card(resolve_model(str(model_path)), name=model_name, context_length=context_length)
        elif kind is ModelType.TOKENS:
            raise ModelError("a token-level model needs model_path (its tokenizer and chat template)")
        elif model_name is None:
            raise ConfigError("register_model needs model_name or model_path")
        else:
            card = ModelCard(name=model_name, context_length=context_length or 0)
    card = msgspec.structs.replace(card, model_type=kind)
    if kv_cache_block_size is not None:
        card = msgspec.structs.replace(card, kv_cache_block_size=kv_cache_block_size)
    runtime = endpoint.runtime
    digest = await runtime.publish_tokenizer(card.tokenizer_json) if card.tokenizer_json else None
    entry = ModelEntry(
        instance_id=runtime.instance_id,
        subject=endpoint.subject,
        card=msgspec.structs.replace(card, tokenizer_json=None, source=None),
        tokenizer_sha256=digest,
        skip_special_tokens=skip_special_tokens,
        user_data=user_data,
    )
    await endpoint.announce(model_key(endpoint.address, runtime.instance_id), msgspec.json.encode(entry))
    log.info("registered model %r (%s) on %s", card.name, kind.value, endpoint.address)
    return card


def worker(main: Callable[[DistributedRuntime], Coroutine[Any, Any, None]]) -> Callable[[], Coroutine[Any, Any, None]]:
    """Decorator for a worker's entry point: connects the runtime, stops on SIGINT/SIGTERM, closes it.

    >>> @worker
    ... async def main(runtime: DistributedRuntime) -> None: ...
    >>> uvloop.run(main())
    """
    import signal

    async def run() -> None:
        runtime = await DistributedRuntime.connect()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, runtime.shutdown)
        try:
            task = asyncio.create_task(main(runtime))
            stop = asyncio.create_task(runtime.wait_for_shutdown())
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
            for pending in (task, stop):
                pending.cancel()
            await asyncio.gather(task, stop, return_exceptions=True)
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        finally:
            await runtime.close()

    return run
