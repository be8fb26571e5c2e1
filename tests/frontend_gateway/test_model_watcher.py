"""The model watcher on real etcd and NATS: bad registrations are skipped, cards must match, restarts resume."""

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import pytest

from frontend_gateway.metrics import GatewayMetrics
from frontend_gateway.models.pipeline import ModelRegistry
from frontend_gateway.models.remote_engines import RemoteTextEngine, RemoteTokenEngine
from frontend_gateway.models.watcher import ModelWatcher, card_differences
from frontend_gateway.routing.basic import RandomRouter, RoundRobinRouter
from runtime.cluster.discovery import MODELS_PREFIX
from runtime.cluster.object_store import publish_tokenizer
from runtime.distributed import DistributedRuntime
from runtime.endpoint import ModelEntry, register_model
from runtime.engine import RequestContext
from runtime.fleet_contract.router_settings import PipelineRouter
from runtime.lora import LoraInfo, lora_id
from runtime.models.card import ModelCard, ModelType
from runtime.models.loading import load_model_card
from tests.infra import EtcdServer, NatsServer


@pytest.fixture
async def runtime(etcd_server: EtcdServer, nats_server: NatsServer) -> AsyncIterator[DistributedRuntime]:
    connected = await DistributedRuntime.connect(nats_url=nats_server.url, etcd_endpoints=[etcd_server.endpoint])
    yield connected
    await connected.close()


@pytest.fixture(scope="module")
def smollm2_card(smollm2: Path) -> ModelCard:
    return load_model_card(smollm2)


@pytest.fixture
def registry() -> ModelRegistry:
    return ModelRegistry()


@pytest.fixture
def metrics() -> GatewayMetrics:
    return GatewayMetrics()


@pytest.fixture
def watcher(runtime: DistributedRuntime, registry: ModelRegistry, metrics: GatewayMetrics) -> ModelWatcher:
    return ModelWatcher(runtime, registry, metrics=metrics)


async def until(watcher: ModelWatcher, condition: Callable[[], bool]) -> None:
    """Wait for the watcher to reach ``condition`` (it sets ``changed`` after every event)."""
    async with asyncio.timeout(30):
        while True:
            watcher.changed.clear()
            if condition():
                return
            await watcher.changed.wait()


def pooled(registry: ModelRegistry, name: str) -> set[int]:
    """The instance ids requests for ``name`` may be routed to."""
    model = registry.get(name)
    assert model is not None, f"{name} is not served"
    assert isinstance(model.engine, RemoteTextEngine | RemoteTokenEngine)
    return {info.instance_id for info in model.engine.instances.snapshot()}


def chat_entry(name: str, instance_id: int, context_length: int = 256) -> bytes:
    card = ModelCard(name=name, model_type=ModelType.CHAT, context_length=context_length)
    entry = ModelEntry(instance_id=instance_id, subject=f"flotilla.test.{instance_id:x}", card=card)
    return msgspec.json.encode(entry)


def key(instance_id: int) -> str:
    return f"{MODELS_PREFIX}test/backend/generate/{instance_id:x}"


async def nothing(payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
    return
    yield b""


async def test_bad_registrations_are_logged_with_their_key_and_do_not_stop_the_watch(
    runtime: DistributedRuntime,
    watcher: ModelWatcher,
    registry: ModelRegistry,
    smollm2_card: ModelCard,
    nats_server: NatsServer,
    etcd_server: EtcdServer,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    broken_json = await publish_tokenizer(runtime.nc, '{"not": "a tokenizer"}')
    timing_out = "ab" * 32
    fetch = runtime.fetch_tokenizer

    async def fetch_or_time_out(digest: str) -> str:
        if digest == timing_out:
            raise nats.errors.TimeoutError  # what nats-py raises when the object store does not answer
        return await fetch(digest)

    monkeypatch.setattr(runtime, "fetch_tokenizer", fetch_or_time_out)
    card = msgspec.structs.replace(smollm2_card, tokenizer_json=None, source=None)
    template = ModelEntry(instance_id=1, subject="flotilla.test.1", card=card, tokenizer_sha256=broken_json)
    bad = {
        key(1): b"{this is not json",
        key(2): msgspec.json.encode(msgspec.structs.replace(template, tokenizer_sha256="00" * 32)),
        key(3): msgspec.json.encode(template),
        key(4): msgspec.json.encode(msgspec.structs.replace(template, tokenizer_sha256=timing_out)),
    }
    for bad_key, value in bad.items():
        await runtime.discovery.register(bad_key, value)
    watch = asyncio.create_task(watcher.run())

    # A real worker registers afterwards, with its tokenizer in the object store.
    good = await DistributedRuntime.connect(nats_url=nats_server.url, etcd_endpoints=[etcd_server.endpoint])
    try:
        endpoint = good.namespace("test").component("good").endpoint("generate")
        await endpoint.serve_bytes(nothing)
        card = msgspec.structs.replace(smollm2_card, name="good")
        await register_model(ModelType.TOKENS, endpoint, card=card)
        await until(watcher, lambda: "good" in registry.names())
        assert pooled(registry, "good") == {good.instance_id}
        assert registry.names() == ["good"]
        skipped = {r.getMessage() for r in caplog.records if r.levelno == logging.WARNING}
        reasons = {
            1: "malformed model entry",
            2: "is not in the object store",
            3: "cannot be loaded",
            4: "TimeoutError",
        }
        for instance_id, reason in reasons.items():
            assert any(key(instance_id) in message and reason in message for message in skipped), (
                f"{key(instance_id)} ({reason}) not logged in {skipped}"
            )
        assert not watch.done()
    finally:
        watch.cancel()
        await good.close()


async def test_a_token_model_s_tokenizer_is_built_off_the_event_loop(
    runtime: DistributedRuntime,
    watcher: ModelWatcher,
    registry: ModelRegistry,
    smollm2_card: ModelCard,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert smollm2_card.tokenizer_json is not None
    digest = await publish_tokenizer(runtime.nc, smollm2_card.tokenizer_json)
    card = msgspec.structs.replace(smollm2_card, tokenizer_json=None, source=None)
    entry = ModelEntry(instance_id=1, subject="flotilla.test.1", card=card, tokenizer_sha256=digest)
    threads: list[int] = []
    prepare = ModelCard.prepare

    def recording_prepare(self: ModelCard, *args: Any) -> ModelCard:
        threads.append(threading.get_ident())
        return prepare(self, *args)

    monkeypatch.setattr(ModelCard, "prepare", recording_prepare)
    await runtime.discovery.register(key(1), msgspec.json.encode(entry))
    watch = asyncio.create_task(watcher.run())
    try:
        await until(watcher, lambda: registry.names() == [smollm2_card.name])
    finally:
        watch.cancel()
    assert threads and threading.get_ident() not in threads


async def test_a_model_that_comes_back_reuses_its_tokenizer(
    runtime: DistributedRuntime,
    watcher: ModelWatcher,
    registry: ModelRegistry,
    smollm2_card: ModelCard,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert smollm2_card.tokenizer_json is not None
    digest = await publish_tokenizer(runtime.nc, smollm2_card.tokenizer_json)
    card = msgspec.structs.replace(smollm2_card, tokenizer_json=None, source=None)
    entry = msgspec.json.encode(ModelEntry(instance_id=1, subject="s.1", card=card, tokenizer_sha256=digest))
    fetched: list[str] = []
    fetch = runtime.fetch_tokenizer

    async def counting_fetch(wanted: str) -> str:
        fetched.append(wanted)
        return await fetch(wanted)

    monkeypatch.setattr(runtime, "fetch_tokenizer", counting_fetch)
    name = smollm2_card.name
    watch = asyncio.create_task(watcher.run())
    try:
        await runtime.discovery.register(key(1), entry)
        await until(watcher, lambda: registry.names() == [name])
        first = registry.get(name)
        assert first is not None and first.card is not None
        # Its only worker restarts: the model leaves and comes back.
        await runtime.discovery.deregister(key(1))
        await until(watcher, lambda: registry.names() == [])
        await runtime.discovery.register(key(1), entry)
        await until(watcher, lambda: registry.names() == [name])
        again = registry.get(name)
        assert again is not None and again is not first and again.card is not None
        assert again.card.tokenizer is first.card.tokenizer
        assert fetched == [digest]
    finally:
        watch.cancel()


async def test_an_instance_whose_card_differs_is_refused_counted_once_and_served_when_the_pool_empties(
    runtime: DistributedRuntime,
    watcher: ModelWatcher,
    registry: ModelRegistry,
    metrics: GatewayMetrics,
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch = asyncio.create_task(watcher.run())
    try:
        await runtime.discovery.register(key(1), chat_entry("m", 1, context_length=256))
        await until(watcher, lambda: "m" in registry.names())
        await runtime.discovery.register(key(2), chat_entry("m", 2, context_length=512))
        await runtime.discovery.register(key(3), chat_entry("m", 3, context_length=256))
        await until(watcher, lambda: pooled(registry, "m") == {1, 3})
        refused = metrics.refused_instances.labels(model="m", reason="context_length")
        assert refused._value.get() == 1
        [warning] = [r.getMessage() for r in caplog.records if "is refused" in r.getMessage()]
        assert "instance 2 of model 'm'" in warning and "context_length (256 vs 512)" in warning

        await runtime.discovery.deregister(key(1))
        await runtime.discovery.deregister(key(3))
        await until(watcher, lambda: "m" in registry.names() and pooled(registry, "m") == {2})
        assert refused._value.get() == 1
    finally:
        watch.cancel()


async def test_a_restarted_watch_resumes_from_what_it_had_applied(
    runtime: DistributedRuntime, watcher: ModelWatcher, registry: ModelRegistry
) -> None:
    watch = asyncio.create_task(watcher.run())
    await runtime.discovery.register(key(1), chat_entry("alpha", 1))
    await runtime.discovery.register(key(2), chat_entry("beta", 2))
    await until(watcher, lambda: registry.names() == ["alpha", "beta"])
    watch.cancel()
    await asyncio.gather(watch, return_exceptions=True)

    # While the watch is down, one model leaves and another arrives.
    await runtime.discovery.deregister(key(1))
    await runtime.discovery.register(key(3), chat_entry("gamma", 3))
    watch = asyncio.create_task(watcher.run())
    try:
        await until(watcher, lambda: registry.names() == ["beta", "gamma"])
    finally:
        watch.cancel()


def test_an_adapter_never_pools_with_a_base_model_or_another_bases_adapter(smollm2_card: ModelCard) -> None:
    base = ModelEntry(instance_id=1, subject="s.1", card=smollm2_card, tokenizer_sha256="aa" * 32)
    adapter = msgspec.structs.replace(base, lora=LoraInfo(name=smollm2_card.name, id=lora_id("x"), base="llm"))
    assert card_differences(base, adapter) == {"lora": "a base model vs an adapter of 'llm'"}
    assert card_differences(adapter, msgspec.structs.replace(adapter, instance_id=2)) == {}
    elsewhere = msgspec.structs.replace(adapter, lora=LoraInfo(name=smollm2_card.name, id=lora_id("x"), base="other"))
    assert set(card_differences(adapter, elsewhere)) == {"lora"}


def test_card_differences_name_every_field_that_would_change_the_answers(smollm2_card: ModelCard) -> None:
    first = ModelEntry(instance_id=1, subject="s.1", card=smollm2_card, tokenizer_sha256="aa" * 32)
    assert card_differences(first, msgspec.structs.replace(first, instance_id=2, subject="s.2")) == {}
    other_card = msgspec.structs.replace(
        smollm2_card,
        model_type=ModelType.CHAT,
        chat_template="{{ messages }}",
        context_length=99,
        kv_cache_block_size=32,
        reasoning_parser="qwen3",
        tool_call_parser="hermes",
        structured_output=True,
        guided_decoding=["json", "choice", "grammar"],
        logprobs=True,
    )
    other: Any = msgspec.structs.replace(first, card=other_card, tokenizer_sha256="bb" * 32)
    differences = card_differences(first, other)
    assert set(differences) == {
        "model_type",
        "tokenizer",
        "chat_template",
        "context_length",
        "kv_cache_block_size",
        "reasoning_parser",
        "tool_call_parser",
        "structured_output",
        "guided_decoding",
        "logprobs",
    }
    assert differences["tool_call_parser"] == "None vs hermes"


def routed_entry(name: str, instance_id: int, mode: str, generation: int) -> bytes:
    card = ModelCard(name=name, model_type=ModelType.CHAT, context_length=256)
    router = PipelineRouter(mode=mode, generation=generation)
    entry = ModelEntry(instance_id=instance_id, subject=f"flotilla.test.{instance_id:x}", card=card, router=router)
    return msgspec.json.encode(entry)


async def test_an_instance_with_newer_router_settings_makes_its_pool_change_routers(
    runtime: DistributedRuntime, watcher: ModelWatcher, registry: ModelRegistry
) -> None:
    """A pipeline's router settings changed: its workers are replaced one by one, the new ones registering
    the settings' next generation; the gateway takes them up at the first, without a restart."""
    watch = asyncio.create_task(watcher.run())
    try:
        await runtime.discovery.register(key(1), routed_entry("m", 1, "round-robin", generation=1))
        await until(watcher, lambda: "m" in registry.names())
        model = registry.get("m")
        assert model is not None and isinstance(model.engine, RemoteTextEngine)
        first_router = model.engine.router
        assert isinstance(first_router, RoundRobinRouter)

        await runtime.discovery.register(key(2), routed_entry("m", 2, "random", generation=2))
        await until(watcher, lambda: pooled(registry, "m") == {1, 2})

        assert isinstance(model.engine.router, RandomRouter)
        # An older generation registering late changes nothing back.
        await runtime.discovery.register(key(3), routed_entry("m", 3, "round-robin", generation=1))
        await until(watcher, lambda: pooled(registry, "m") == {1, 2, 3})
        assert isinstance(model.engine.router, RandomRouter)
    finally:
        watch.cancel()


async def test_a_later_instance_with_other_router_settings_of_no_newer_generation_is_warned_about_once(
    runtime: DistributedRuntime, watcher: ModelWatcher, registry: ModelRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    watch = asyncio.create_task(watcher.run())
    try:
        await runtime.discovery.register(key(1), routed_entry("m", 1, "round-robin", generation=3))
        await until(watcher, lambda: "m" in registry.names())
        model = registry.get("m")
        assert model is not None and isinstance(model.engine, RemoteTextEngine)
        router = model.engine.router
        with caplog.at_level(logging.WARNING, logger="frontend_gateway.models.watcher"):
            # Same generation, other settings (two workers started by hand with other --router-* flags).
            await runtime.discovery.register(key(2), routed_entry("m", 2, "random", generation=3))
            await until(watcher, lambda: pooled(registry, "m") == {1, 2})
            # Its registration changed (not its settings): no second warning.
            entry = msgspec.json.decode(routed_entry("m", 2, "random", generation=3), type=ModelEntry)
            await runtime.discovery.register(key(2), msgspec.json.encode(msgspec.structs.replace(entry, subject="s.2")))
            await until(watcher, lambda: watcher._pooled[key(2)].subject == "s.2")
            # An older generation: ignored too, and said; the same settings of another generation: nothing to say.
            await runtime.discovery.register(key(3), routed_entry("m", 3, "random", generation=2))
            await runtime.discovery.register(key(4), routed_entry("m", 4, "round-robin", generation=1))
            await until(watcher, lambda: pooled(registry, "m") == {1, 2, 3, 4})
        assert model.engine.router is router  # the first instance's settings, of the newest generation, stand
        warnings = [record.getMessage() for record in caplog.records if "router settings" in record.getMessage()]
        assert len(warnings) == 2, warnings
        assert warnings[0].startswith("instance 2 of model 'm' registered other router settings")
        assert warnings[0].endswith(": mode (round-robin vs random)")
        assert warnings[1].startswith("instance 3 of model 'm'")
        assert warnings[1].endswith(": mode (round-robin vs random), generation (3 vs 2)")
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
