"""The model watcher: keeps the gateway's model registry in step with what workers register in etcd.

A model appears when its first instance registers and disappears when its last one leaves; each
model is a TokenModel or TextModel whose engine forwards to the model's instances
(frontend_gateway/remote_engines.py).
"""

import asyncio
import logging

import msgspec

from frontend_gateway.pipeline import ModelRegistry, ServedModel, TextModel, TokenModel
from frontend_gateway.remote_engines import InstanceSet, RemoteTextEngine, RemoteTokenEngine
from frontend_gateway.router import InstanceInfo, Router, RouterMode
from runtime.discovery import MODELS_PREFIX, WatchEvent
from runtime.distributed import DistributedRuntime
from runtime.endpoint import ModelEntry
from runtime.errors import EngineError, FlotillaError
from runtime.model_card import ModelCard, ModelType

log = logging.getLogger(__name__)

_model_entry = msgspec.json.Decoder(ModelEntry)


class _WatchedModel:
    def __init__(self, served: ServedModel, instances: InstanceSet, card: ModelCard, first_key: str) -> None:
        self.served = served
        self.instances = instances
        self.card = card  # as the first instance registered it
        self.first_key = first_key


class ModelWatcher:
    """Keeps ``registry`` in step with the models workers register in etcd."""

    def __init__(
        self,
        runtime: DistributedRuntime,
        registry: ModelRegistry,
        *,
        router_mode: RouterMode = RouterMode.ROUND_ROBIN,
        migration_limit: int = 0,
    ) -> None:
        self.runtime = runtime
        self.registry = registry
        self.router_mode = router_mode
        self.migration_limit = migration_limit
        self._models: dict[str, _WatchedModel] = {}
        self._keys: dict[str, tuple[str, int]] = {}
        self.changed = asyncio.Event()  # set after every applied change (tests await it)

    async def run(self) -> None:
        """Apply registrations and removals until cancelled."""
        async for event in self.runtime.discovery.watch_prefix(MODELS_PREFIX):
            try:
                await self.apply(event)
            except FlotillaError as exc:
                log.warning("ignored model registration %s: %s", event.key, exc)
            self.changed.set()

    async def apply(self, event: WatchEvent) -> None:
        if event.kind == "delete":
            found = self._keys.pop(event.key, None)
            if found is not None:
                self._drop_instance(*found)
            return
        assert event.value is not None
        try:
            entry = _model_entry.decode(event.value)
        except msgspec.DecodeError as exc:
            raise EngineError(f"malformed model entry: {exc}") from exc
        name = entry.card.name
        previous = self._keys.get(event.key)
        if previous is not None and previous[0] != name:
            self._drop_instance(*previous)
        watched = self._models.get(name)
        if watched is None:
            watched = self._models[name] = await self._build(entry, event.key)
            self.registry.add(watched.served)
            log.info("model %r is now served (%s)", name, entry.card.model_type.value)
        elif (
            entry.card.model_type is not watched.card.model_type
            or entry.card.chat_template != watched.card.chat_template
        ):
            # Instances are pooled by model name; one whose card differs would answer differently.
            log.warning(
                "instance %x registers model %r with a different card than %s; it is pooled with the others",
                entry.instance_id, name, watched.first_key,
            )  # fmt: skip
        watched.instances.add(InstanceInfo(entry.instance_id, entry.subject))
        self._keys[event.key] = (name, entry.instance_id)

    def _drop_instance(self, name: str, instance_id: int) -> None:
        watched = self._models.get(name)
        if watched is None:
            return
        watched.instances.remove(instance_id)
        if not watched.instances:
            del self._models[name]
            self.registry.remove(name)
            log.info("model %r has no instance left and is no longer served", name)

    async def _build(self, entry: ModelEntry, key: str) -> _WatchedModel:
        card = entry.card
        instances = InstanceSet()
        router = Router(self.router_mode)
        if card.model_type is ModelType.TOKENS:
            if entry.tokenizer_sha256 is None:
                raise EngineError(f"token-level model {card.name!r} was registered without a tokenizer")
            card = msgspec.structs.replace(
                card, tokenizer_json=await self.runtime.fetch_tokenizer(entry.tokenizer_sha256)
            )
            engine = RemoteTokenEngine(
                card.name, instances, router, self.runtime, self.migration_limit,
                skip_special_tokens=entry.skip_special_tokens,
            )  # fmt: skip
            return _WatchedModel(TokenModel(card, engine), instances, entry.card, key)
        text_engine = RemoteTextEngine(card.name, instances, router, self.runtime, self.migration_limit)
        return _WatchedModel(TextModel(card.name, text_engine, card.context_length or None), instances, entry.card, key)
