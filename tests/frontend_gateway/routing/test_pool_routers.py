"""Each model pool's router: built by the watcher from the settings, told of instances, closed with the pool."""

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec
import pytest
from nats.aio.msg import Msg

from frontend_gateway.models import watcher as model_watcher
from frontend_gateway.models.pipeline import ModelRegistry
from frontend_gateway.models.remote_engines import RemoteTextEngine, RemoteTokenEngine
from frontend_gateway.models.watcher import ModelWatcher, endpoint_of_model_key
from frontend_gateway.routing.kv_router import KvRouter
from frontend_gateway.routing.protocol import Decision, InstanceInfo, Router, RouterMode, RouterSettings
from runtime.cluster.addressing import EndpointAddress
from runtime.cluster.discovery import MODELS_PREFIX
from runtime.cluster.nats_connection import connect_nats, flush
from runtime.distributed import DistributedRuntime
from runtime.endpoint import ModelEntry
from runtime.fleet_contract.router_settings import PipelineRouter
from runtime.kv.events import BlockStored, KvEventBatch
from runtime.models.card import ModelCard, ModelType
from runtime.protocol import PreprocessedRequest, TextRequest
from tests.frontend_gateway.routing import waiting
from tests.infra import EtcdServer, NatsServer


class RecordingRouter:
    """A router that routes round-robin and notes every call the watcher makes."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def start(self) -> None:
        self.calls.append("start")

    async def close(self) -> None:
        self.calls.append("close")

    def choose(self, request: PreprocessedRequest | TextRequest, candidates: Sequence[InstanceInfo]) -> Decision | None:
        return Decision(candidates[0]) if candidates else None

    def prefill_done(self, request_id: str) -> None:
        self.calls.append(f"prefill_done {request_id}")

    def finished(self, request_id: str) -> None:
        self.calls.append(f"finished {request_id}")

    def kv_usage(self, instance_id: int, dp_rank: int | None) -> float | None:
        return None

    def busy(self, instance_id: int) -> bool:
        return False

    def instance_added(self, instance: InstanceInfo) -> None:
        self.calls.append(f"added {instance.instance_id}")

    def instance_removed(self, instance_id: int) -> None:
        self.calls.append(f"removed {instance_id}")


@pytest.fixture
async def runtime(etcd_server: EtcdServer, nats_server: NatsServer) -> AsyncIterator[DistributedRuntime]:
    connected = await DistributedRuntime.connect(nats_url=nats_server.url, etcd_endpoints=[etcd_server.endpoint])
    yield connected
    await connected.close()


def key(instance_id: int, component: str = "backend") -> str:
    return f"{MODELS_PREFIX}llm/{component}/generate/{instance_id:x}"


def chat_entry(name: str, instance_id: int, block_size: int = 32, router: PipelineRouter | None = None) -> bytes:
    card = ModelCard(name=name, model_type=ModelType.CHAT, context_length=256, kv_cache_block_size=block_size)
    entry = ModelEntry(instance_id=instance_id, subject=f"s.{instance_id:x}", card=card, router=router)
    return msgspec.json.encode(entry)


async def until(watcher: ModelWatcher, condition: Callable[[], bool]) -> None:
    await waiting.until(watcher, condition, within_s=30)


def router_of(registry: ModelRegistry, name: str) -> Router:
    model = registry.get(name)
    assert model is not None and isinstance(model.engine, RemoteTextEngine | RemoteTokenEngine)
    return model.engine.router


async def test_a_pools_router_is_started_told_of_instances_and_closed_when_the_pool_goes(
    runtime: DistributedRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[tuple[RecordingRouter, RouterSettings, int, EndpointAddress | None]] = []

    def build(
        settings: RouterSettings, *, block_size: int, nc: Any, address: EndpointAddress | None, **kwargs: Any
    ) -> Router:
        router = RecordingRouter()
        built.append((router, settings, block_size, address))
        return router

    monkeypatch.setattr(model_watcher, "build_router", build)
    settings = RouterSettings(mode=RouterMode.KV, overlap_score_weight=2.0)
    registry = ModelRegistry()
    watcher = ModelWatcher(runtime, registry, router=settings)
    watch = asyncio.create_task(watcher.run())
    try:
        await runtime.discovery.register(key(1), chat_entry("m", 1, block_size=64))
        await runtime.discovery.register(key(2), chat_entry("m", 2, block_size=64))
        await until(watcher, lambda: len(built) == 1 and "added 2" in built[0][0].calls)
        router, used_settings, block_size, address = built[0]
        assert (used_settings, block_size, address) == (settings, 64, EndpointAddress("llm", "backend", "generate"))
        assert router_of(registry, "m") is router
        assert router.calls == ["start", "added 1", "added 2"]
        await runtime.discovery.deregister(key(1))
        await runtime.discovery.deregister(key(2))
        await until(watcher, lambda: registry.names() == [])
        assert router.calls[3:] == ["removed 1", "removed 2", "close"]
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)


async def test_closing_the_watcher_closes_every_router_and_builds_no_more(
    runtime: DistributedRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    routers: list[RecordingRouter] = []

    def build(settings: RouterSettings, **kwargs: Any) -> Router:
        routers.append(RecordingRouter())
        return routers[-1]

    monkeypatch.setattr(model_watcher, "build_router", build)
    registry = ModelRegistry()
    watcher = ModelWatcher(runtime, registry)
    watch = asyncio.create_task(watcher.run())
    try:
        await runtime.discovery.register(key(1), chat_entry("a", 1))
        await runtime.discovery.register(key(2), chat_entry("b", 2))
        await until(watcher, lambda: registry.names() == ["a", "b"])
        await watcher.close()
        assert [router.calls[-1] for router in routers] == ["close", "close"]
        await runtime.discovery.register(key(3), chat_entry("c", 3))
        await until(watcher, lambda: key(3) in watcher._applied)
        assert len(routers) == 2
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)


async def test_in_kv_mode_each_pool_gets_a_kv_router_on_its_component_with_the_cards_block_size(
    runtime: DistributedRuntime,
) -> None:
    registry = ModelRegistry()
    watcher = ModelWatcher(runtime, registry, router=RouterSettings(mode=RouterMode.KV))
    watch = asyncio.create_task(watcher.run())
    try:
        await runtime.discovery.register(key(1, component="prefill"), chat_entry("m", 1, block_size=48))
        await until(watcher, lambda: registry.names() == ["m"])
        router = router_of(registry, "m")
        assert isinstance(router, KvRouter)
        assert (router.block_size, router.address) == (48, EndpointAddress("llm", "prefill", "generate"))
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await watcher.close()


async def test_a_card_whose_block_size_cannot_be_routed_by_kv_is_skipped_with_a_reason(
    runtime: DistributedRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    registry = ModelRegistry()
    watcher = ModelWatcher(runtime, registry, router=RouterSettings(mode=RouterMode.KV))
    watch = asyncio.create_task(watcher.run())
    try:
        await runtime.discovery.register(key(1), chat_entry("broken", 1, block_size=0))
        await runtime.discovery.register(key(2), chat_entry("fine", 2))
        await until(watcher, lambda: registry.names() == ["fine"])
        assert "model 'broken' cannot be routed: the KV block size must be at least 1, not 0" in caplog.text
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await watcher.close()


@pytest.mark.parametrize(
    ("model_key", "address"),
    [
        (f"{MODELS_PREFIX}ns/comp/ep/1f", EndpointAddress("ns", "comp", "ep")),
        (f"{MODELS_PREFIX}ns/comp/1f", None),
        (f"{MODELS_PREFIX}ns/c.mp/ep/1f", None),
        ("elsewhere/ns/comp/ep/1f", None),
        # A LoRA adapter the instance serves (runtime/cluster/discovery.py adapter_model_key); names may hold "/".
        (f"{MODELS_PREFIX}ns/comp/ep/1f/lora/org/sql-expert", EndpointAddress("ns", "comp", "ep")),
        (f"{MODELS_PREFIX}ns/comp/ep/1f/other/sql-expert", None),
    ],
)
def test_the_endpoint_of_a_model_key_is_read_from_its_path(model_key: str, address: EndpointAddress | None) -> None:
    assert endpoint_of_model_key(model_key) == address


async def test_each_model_is_routed_as_its_workers_registered_else_as_the_gateway_says(
    runtime: DistributedRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: dict[str, RouterSettings] = {}

    def build(
        settings: RouterSettings, *, block_size: int, nc: Any, address: EndpointAddress | None, **kwargs: Any
    ) -> Router:
        built[f"{len(built)}"] = settings
        return RecordingRouter()

    monkeypatch.setattr(model_watcher, "build_router", build)
    gateway = RouterSettings(mode=RouterMode.ROUND_ROBIN, predicted_ttl_s=30.0)
    registry = ModelRegistry()
    watcher = ModelWatcher(runtime, registry, router=gateway)
    watch = asyncio.create_task(watcher.run())
    try:
        # Pipeline "a" asks for KV routing; "b" registers nothing and gets the gateway's own settings.
        pipeline = PipelineRouter(
            mode="kv", overlap_score_weight=4.0, queued_prefill_weight=0.25, temperature=0.5, use_kv_events=False
        )
        await runtime.discovery.register(key(1), chat_entry("a", 1, router=pipeline))
        await until(watcher, lambda: registry.names() == ["a"])
        await runtime.discovery.register(key(2), chat_entry("b", 2))
        await until(watcher, lambda: registry.names() == ["a", "b"])
        assert built["0"] == RouterSettings(
            mode=RouterMode.KV,
            overlap_score_weight=4.0,
            queued_prefill_weight=0.25,
            temperature=0.5,
            use_kv_events=False,
            predicted_ttl_s=30.0,
        )
        assert built["1"] == gateway
        # A mode no router has: the model is not served, and the watch goes on.
        await runtime.discovery.register(key(3), chat_entry("c", 3, router=PipelineRouter(mode="fastest")))
        await runtime.discovery.register(key(4), chat_entry("d", 4))
        await until(watcher, lambda: registry.names() == ["a", "b", "d"])
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)


async def test_a_kv_pool_spanning_components_hears_each_component_s_events_and_answers(
    runtime: DistributedRuntime, nats_server: NatsServer
) -> None:
    registry = ModelRegistry()
    watcher = ModelWatcher(runtime, registry, router=RouterSettings(mode=RouterMode.KV))
    watch = asyncio.create_task(watcher.run())
    workers = await connect_nats(nats_server.url, name="workers")
    other = EndpointAddress("llm", "other", "generate")
    asked: list[str] = []

    async def answer_state(message: Msg) -> None:
        asked.append(message.subject)
        await message.respond(
            msgspec.msgpack.encode(KvEventBatch(instance_id=2, event_id=0, events=[BlockStored([7])]))
        )

    await workers.subscribe(other.kv_state_subject(2), cb=answer_state)
    await flush(workers)
    try:
        await runtime.discovery.register(key(1), chat_entry("m", 1, block_size=16))
        await until(watcher, lambda: registry.names() == ["m"])
        router = router_of(registry, "m")
        assert isinstance(router, KvRouter)
        await runtime.discovery.register(key(2, component="other"), chat_entry("m", 2, block_size=16))
        # Instance 2 is asked for its cache on its own component's subject, and its answer counts.
        await kv_until(router, lambda: router.indexer.find_matches([7]) == {(2, 0): 1})
        assert asked == [other.kv_state_subject(2)]
        # Its events, published on its component's subject, are heard.
        stored = KvEventBatch(instance_id=2, event_id=1, events=[BlockStored([8], parent_hash=7)])
        await workers.publish(other.kv_events_subject(), msgspec.msgpack.encode(stored))
        await flush(workers)
        await kv_until(router, lambda: router.indexer.find_matches([7, 8]) == {(2, 0): 2})
        # Once its last instance leaves, the component is no longer listened to.
        await runtime.discovery.deregister(key(2, component="other"))
        await until(watcher, lambda: pooled_ids(registry, "m") == {1})
        assert router.subscriber.component_names() == ["llm.backend"]
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await watcher.close()
        await workers.close()


def pooled_ids(registry: ModelRegistry, name: str) -> set[int]:
    model = registry.get(name)
    assert model is not None and isinstance(model.engine, RemoteTextEngine | RemoteTokenEngine)
    return {info.instance_id for info in model.engine.instances.snapshot()}


async def kv_until(router: KvRouter, condition: Callable[[], bool]) -> None:
    """Wait for the KV router to reach ``condition`` (it sets ``changed`` after every message it hears)."""
    async with asyncio.timeout(10):
        while True:
            router.changed.clear()
            if condition():
                return
            await router.changed.wait()
