"""The model watcher: keeps the gateway's model registry in step with what workers register in etcd.

A model appears when its first instance registers and disappears when its last one leaves; each
model is a TokenModel or TextModel whose engine forwards to the model's instances
(frontend_gateway/models/remote_engines.py).

Instances are pooled by model name, so every instance of a pool must answer the same way: one whose
card differs from the pool's (``card_differences``) is refused, logged once and counted, and joins
a new pool if the old one empties.

Each pool has its own router (frontend_gateway/routing/), built from the router settings its first
instance registered (its pipeline's) or else the watcher's ``RouterSettings``, with the pool's card
block size, started with the pool and closed when the pool goes; it hears of every instance that joins
or leaves. An instance that registers a later generation of its pipeline's router settings (the
control plane rolls a change of them out to the workers) makes the pool change routers, without a
restart. A later instance whose router settings differ from those the pool routes with, and are of
no later generation, changes nothing: a warning (once per instance) names the settings that differ.
The control plane's rule decides (``PipelineRouter.generation``): the newest generation wins, and
between settings of one generation the first instance's. A registration that cannot be applied (a
malformed entry, a tokenizer missing or broken, a NATS timeout) is logged with its key and skipped: it
never stops the watch.

A LoRA adapter a worker serves beside its base model (runtime/lora.py) is registered as a model of its own
(``ModelEntry.lora``, under ``.../{id}/lora/{adapter}``): it is pooled by its name like any model, with its own
router (whose KV index takes that adapter's blocks only), its requests carry ``lora_name``, and ``/v1/models``
lists it with its base model as ``parent``.

Prefill workers (registered with the role "prefill", ``flotilla run --disagg-role prefill``) make a pool of
their own per model, with its own router on their component, which serves nothing by itself: the model's
(aggregated or decode) pool sends each request's prompt there first, as its ``DisaggPolicy`` decides
(remote_engines.py), while the prefill pool has an instance whose card matches its own.

A model's first instance takes a few hundred ms to take in (its tokenizer fetched and built, its router
started) after it registered, which is when its agent reports it ready: a request for that model in the
meantime waits for the pool (``arrival``, at most ARRIVAL_WAIT_S) instead of being refused.
"""

import asyncio
import contextlib
import dataclasses
import logging

import msgspec
from tokenizers import Tokenizer

from frontend_gateway.metrics import GatewayMetrics
from frontend_gateway.models.pipeline import ModelRegistry, ServedModel, TextModel, TokenModel
from frontend_gateway.models.remote_engines import InstanceSet, RemoteTextEngine, RemoteTokenEngine
from frontend_gateway.request_log import RecordPublisher
from frontend_gateway.routing.disagg_policy import DisaggMode, DisaggPolicy
from frontend_gateway.routing.factory import build_router
from frontend_gateway.routing.health import RoutingHealth
from frontend_gateway.routing.protocol import InstanceInfo, Router, RouterMode, RouterSettings
from runtime.cluster.addressing import EndpointAddress
from runtime.cluster.discovery import ADAPTER_KEY_PART, MODELS_PREFIX, WatchEvent
from runtime.distributed import DistributedRuntime
from runtime.endpoint import ModelEntry
from runtime.errors import EngineError, FlotillaError
from runtime.models.card import ModelCard, ModelType

log = logging.getLogger(__name__)

_model_entry = msgspec.json.Decoder(ModelEntry)
# Tokenizers kept after their model left, by digest: building one holds the GIL (~100 ms for SmolLM2) on
# whichever thread, so a model that comes back (its only worker restarted) must not stall the streams again.
TOKENIZERS_KEPT = 4
#: The longest a request waits for its model's first instance to be taken in (a tokenizer fetched from
#: the object store, a router that asks the workers for their KV state: seconds at worst).
ARRIVAL_WAIT_S = 10.0


def card_differences(pool: ModelEntry, new: ModelEntry) -> dict[str, str]:
    """What in ``new``'s card would make it answer differently from ``pool``'s instances.

    Returns {field: "pool value vs new value"}; empty when ``new`` may join the pool.
    """
    first, card = pool.card, new.card
    differences: dict[str, str] = {}
    # A LoRA adapter's name answers with that adapter of that base model, wherever it is loaded.
    if (pool.lora and (pool.lora.base, pool.lora.id)) != (new.lora and (new.lora.base, new.lora.id)):
        differences["lora"] = f"{_adapter(pool)} vs {_adapter(new)}"
    if card.model_type is not first.model_type:
        differences["model_type"] = f"{first.model_type.value} vs {card.model_type.value}"
    if new.tokenizer_sha256 != pool.tokenizer_sha256:
        differences["tokenizer"] = f"{_short(pool.tokenizer_sha256)} vs {_short(new.tokenizer_sha256)}"
    if card.chat_template != first.chat_template:
        differences["chat_template"] = "the templates differ"
    if card.context_length != first.context_length:
        differences["context_length"] = f"{first.context_length} vs {card.context_length}"
    if card.kv_cache_block_size != first.kv_cache_block_size:
        differences["kv_cache_block_size"] = f"{first.kv_cache_block_size} vs {card.kv_cache_block_size}"
    # The pool's card decides what its requests may ask (JSON output, logprobs) and how answers are
    # parsed: an instance that cannot honour them, or was started to be parsed otherwise, is not one of it.
    capabilities = ("structured_output", "guided_decoding", "logprobs", "prompt_logprobs", "logit_bias")
    for name in ("reasoning_parser", "tool_call_parser", *capabilities):
        if (value := getattr(card, name)) != (pooled := getattr(first, name)):
            differences[name] = f"{pooled} vs {value}"
    return differences


def _newer_router(current: ModelEntry, new: ModelEntry) -> bool:
    """Whether ``new`` registered router settings of a later generation than ``current``'s."""
    if new.router is None:
        return False
    return current.router is None or new.router.generation > current.router.generation


def router_differences(pool: ModelEntry, new: ModelEntry) -> dict[str, str]:
    """The router settings ``new`` registered that differ from those ``pool`` routes with.

    Returns {setting: "pool value vs new value"}, with the generations when they differ too; empty when
    ``new`` registered none (it takes whatever its pool is routed with) or settings that route alike.
    """
    ours, theirs = pool.router, new.router
    if theirs is None or ours is None or theirs == ours:
        return {}  # (settings registered to a pool routed with the gateway's own are a newer generation)
    differences: dict[str, str] = {}
    for field in theirs.__struct_fields__:
        if (value := getattr(theirs, field)) != (pooled := getattr(ours, field)) and field != "generation":
            differences[field] = f"{pooled} vs {value}"
    if differences and theirs.generation != ours.generation:
        differences["generation"] = f"{ours.generation} vs {theirs.generation}"
    return differences


def _adapter(entry: ModelEntry) -> str:
    return "a base model" if entry.lora is None else f"an adapter of {entry.lora.base!r}"


def _short(digest: str | None) -> str:
    return "none" if digest is None else f"sha256 {digest[:12]}"


class _Pool:
    """One served model and its instances; ``entry`` is the first instance's, which others must match.

    ``engine`` is what forwards the model's requests, with ``router``; ``router_entry`` is the entry whose
    registered router settings the router was built with (the newest generation seen).
    """

    def __init__(
        self,
        served: ServedModel,
        engine: RemoteTokenEngine | RemoteTextEngine,
        router: Router,
        entry: ModelEntry,
        first_key: str,
    ) -> None:
        self.served = served
        self.engine = engine
        self.instances = engine.instances
        self.router = router
        self.entry = entry
        self.router_entry = entry
        self.first_key = first_key


class ModelWatcher:
    """Keeps ``registry`` in step with the models workers register in etcd.

    ``run()`` may be restarted after a failure: it resumes from the keys it already applied.
    """

    def __init__(
        self,
        runtime: DistributedRuntime,
        registry: ModelRegistry,
        *,
        router: RouterSettings | None = None,
        migration_limit: int = 0,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.runtime = runtime
        self.registry = registry
        self.router_settings = router or RouterSettings()
        self.migration_limit = migration_limit
        self.metrics = metrics
        self._pools: dict[str, _Pool] = {}
        self._prefill_pools: dict[str, _Pool] = {}  # model name -> its prefill instances, when it has some
        # model name -> (its pool's entry, its prefill pool's entry, whether their cards match), checked once a pair
        self._prefill_fits: dict[str, tuple[ModelEntry, ModelEntry, bool]] = {}
        self._pooled: dict[str, ModelEntry] = {}  # etcd key -> the entry of an instance in a pool
        self._refused: dict[str, ModelEntry] = {}  # etcd key -> an entry kept out of its model's pool
        self._router_warned: set[str] = set()  # etcd keys whose ignored router settings were logged
        self._applied: dict[str, bytes] = {}  # etcd key -> its value, for every key pooled or refused
        self._tokenizers: dict[str, tuple[str, Tokenizer]] = {}  # digest -> (JSON, tokenizer), oldest first
        self.changed = asyncio.Event()  # set after every event handled (tests await it)
        self._arrivals: dict[str, asyncio.Event] = {}  # model name -> set once its first instance is taken in
        self._closed = False
        # The gateway's finished requests, to the control plane's request log over this runtime's NATS.
        self.request_log = RecordPublisher(
            runtime.nc, on_dropped=None if metrics is None else metrics.request_records_dropped_count
        )
        registry.request_log = self.request_log

    async def run(self) -> None:
        """Apply registrations and removals until cancelled."""
        async for event in self.runtime.discovery.watch_prefix(MODELS_PREFIX, known=self._applied):
            try:
                await self.apply(event)
            except FlotillaError as exc:
                log.warning("skipped model registration %s: %s", event.key, exc)
            except Exception as exc:
                # Not ours (a NATS timeout, a library's error): the traceback may tell what went wrong.
                log.warning("skipped model registration %s: %s: %s", event.key, type(exc).__name__, exc, exc_info=True)
            self.changed.set()

    def instance_counts(self) -> dict[str, int]:
        """How many instances each served model has (those whose card differs from its pool's not counted)."""
        return {name: len(pool.instances) for name, pool in self._pools.items()}

    async def close(self) -> None:
        """Close every pool's router and the request log (the ingress is stopping); the registry keeps its models.

        Registrations that arrive afterwards build no pool (their router would never be closed).
        """
        self._closed = True
        await self.request_log.close()
        pools = [*self._pools.values(), *self._prefill_pools.values()]
        self._pools, self._prefill_pools = {}, {}
        for pool in pools:
            await _close_router(pool)

    async def apply(self, event: WatchEvent) -> None:
        """Apply one change. Raises for a registration that cannot be applied (it is then not kept)."""
        if event.kind == "delete":
            await self._forget(event.key)
            return
        assert event.value is not None
        if self._applied.get(event.key) == event.value:
            return  # the same registration put again (a lease renewed): nothing changes, nothing is logged
        try:
            entry = _model_entry.decode(event.value)
        except msgspec.DecodeError as exc:
            await self._forget(event.key)
            raise EngineError(f"malformed model entry: {exc}") from exc
        name = entry.card.name
        arrival = None
        if entry.role != "prefill" and name not in self._pools and name not in self._arrivals and not self._closed:
            arrival = self._arrivals[name] = asyncio.Event()  # its first instance: requests wait for the pool
        try:
            if not self._still_fits(event.key, entry):
                await self._forget(event.key)
            await self._admit(event.key, entry)
            self._applied[event.key] = event.value
        finally:
            if arrival is not None:
                del self._arrivals[name]
                arrival.set()

    async def arrival(self, name: str) -> None:
        """Return once model ``name`` is served, if its first instance is being taken in (at most
        ARRIVAL_WAIT_S); at once otherwise. A pool that cannot be built ends the wait too."""
        arriving = self._arrivals.get(name)
        if arriving is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(ARRIVAL_WAIT_S):
                    await arriving.wait()

    def _still_fits(self, key: str, entry: ModelEntry) -> bool:
        """Whether ``key``, pooled already, may stay in its pool with ``entry`` (else it is forgotten first)."""
        previous = self._pooled.get(key)
        if previous is None or previous.card.name != entry.card.name or previous.role != entry.role:
            return False
        pool = self._pools_of(entry).get(entry.card.name)
        return pool is not None and not card_differences(pool.entry, entry)

    def _pools_of(self, entry: ModelEntry) -> dict[str, _Pool]:
        """The pools ``entry``'s instance belongs in: the prefill pools, or the served models' pools."""
        return self._prefill_pools if entry.role == "prefill" else self._pools

    def _prefill_engine(self, name: str) -> RemoteTokenEngine | None:
        """The engine of model ``name``'s prefill instances, if it has some whose card matches its pool's."""
        prefill, pool = self._prefill_pools.get(name), self._pools.get(name)
        if prefill is None or pool is None or not isinstance(prefill.engine, RemoteTokenEngine):
            return None
        fit = self._prefill_fits.get(name)
        if fit is None or fit[0] is not pool.entry or fit[1] is not prefill.entry:
            # Once per pair of first entries, not per request: a card holds a whole chat template.
            differences = card_differences(pool.entry, prefill.entry)
            if differences:
                details = ", ".join(f"{field} ({values})" for field, values in differences.items())
                log.warning(
                    "the prefill instances of model %r are not used: their card differs from its pool's in %s",
                    name, details,
                )  # fmt: skip
            fit = self._prefill_fits[name] = (pool.entry, prefill.entry, not differences)
        return prefill.engine if fit[2] else None

    async def _admit(self, key: str, entry: ModelEntry) -> None:
        """Add the instance to its model's pool, creating the pool, or refuse it if its card differs."""
        name = entry.card.name
        pools = self._pools_of(entry)
        pool = pools.get(name)
        if pool is None:
            if self._closed:
                return
            if entry.role == "prefill" and entry.card.model_type is not ModelType.TOKENS:
                raise EngineError(f"prefill instances need a token-level model; {name!r} is {entry.card.model_type}")
            pool = await self._build(entry, key)
            try:
                await pool.router.start()
            except BaseException:
                await _close_router(pool)
                raise
            pools[name] = pool
            mode = self.settings_for(entry).mode.value
            if entry.role == "prefill":
                log.info("model %r has prefill instances now (%s routing)", name, mode)
            else:
                self.registry.add(pool.served)
                log.info("model %r is now served (%s, %s routing)", name, entry.card.model_type.value, mode)
        elif differences := card_differences(pool.entry, entry):
            self._refused[key] = entry
            details = ", ".join(f"{field} ({values})" for field, values in differences.items())
            log.warning(
                "instance %x of model %r is refused: its card differs from the one %s registered in %s",
                entry.instance_id, name, pool.first_key, details,
            )  # fmt: skip
            if self.metrics is not None:
                self.metrics.refused_instance(name, ",".join(differences))
            return
        elif _newer_router(pool.router_entry, entry):
            await self._reroute(pool, entry, key)
        elif (differences := router_differences(pool.router_entry, entry)) and key not in self._router_warned:
            self._router_warned.add(key)
            details = ", ".join(f"{field} ({values})" for field, values in differences.items())
            log.warning(
                "instance %x of model %r registered other router settings than its pool is routed with, of no "
                "later generation; they are ignored (the newest generation wins, then the first instance's): %s",
                entry.instance_id, name, details,
            )  # fmt: skip
        instance = InstanceInfo(
            entry.instance_id, entry.subject, endpoint_of_model_key(key), entry.embed_subject, entry.kv_events,
            entry.prefill_token_capacity,
        )  # fmt: skip
        pool.instances.add(instance)
        pool.router.instance_added(instance)
        if entry.role == "decode" and isinstance(pool.engine, RemoteTokenEngine):
            pool.engine.decode_role = True  # a disaggregated model: its requests go through the policy
        self._pooled[key] = entry

    async def _reroute(self, pool: _Pool, entry: ModelEntry, key: str) -> None:
        """Route ``pool`` with the newer settings ``entry`` registered (its pipeline's router settings were
        changed, and its workers are being replaced): a new router, told of every instance, takes over.
        Requests routed by the old one end normally (a router ignores the ids it did not route)."""
        router = self._router(entry, key)
        try:
            await router.start()
        except BaseException:
            await router.close()
            raise
        for instance in pool.instances.snapshot():
            router.instance_added(instance)
        old = pool.router
        pool.router = pool.engine.router = router
        pool.router_entry = entry
        if isinstance(pool.engine, RemoteTokenEngine):
            pool.engine.disagg = self.settings_for(entry).disagg
        log.info(
            "model %r is now routed with generation %d of its router settings (%s routing)",
            entry.card.name,
            entry.router.generation if entry.router is not None else 0,
            self.settings_for(entry).mode.value,
        )
        try:
            await old.close()
        except Exception:
            log.exception("closing the previous router of model %r failed", entry.card.name)

    async def _forget(self, key: str) -> None:
        """Drop what ``key`` registered; a model whose last instance left is no longer served."""
        self._applied.pop(key, None)
        self._router_warned.discard(key)
        if self._refused.pop(key, None) is not None:
            return
        entry = self._pooled.pop(key, None)
        if entry is None:
            return
        name = entry.card.name
        pools = self._pools_of(entry)
        pool = pools.get(name)
        if pool is None:
            return
        pool.instances.remove(entry.instance_id)
        pool.router.instance_removed(entry.instance_id)
        if pool.instances:
            return
        del pools[name]
        await _close_router(pool)
        if entry.role == "prefill":
            log.info("model %r has no prefill instance left: its prompts are computed where they decode", name)
        else:
            self.registry.remove(name)
            log.info("model %r has no instance left and is no longer served", name)
        await self._readmit(name, prefill=entry.role == "prefill")

    async def _readmit(self, name: str, *, prefill: bool) -> None:
        """Give the instances refused from ``name``'s emptied pool (its prefill pool) their turn: the first
        founds a new pool."""
        refused = self._refused.items()
        for key, entry in [(k, e) for k, e in refused if e.card.name == name and (e.role == "prefill") == prefill]:
            del self._refused[key]
            try:
                await self._admit(key, entry)
            except Exception as exc:
                self._applied.pop(key, None)
                log.warning("skipped model registration %s: %s: %s", key, type(exc).__name__, exc)

    async def _build(self, entry: ModelEntry, key: str) -> _Pool:
        """A pool for ``entry``'s model (its prefill pool for a prefill instance), its router built but not
        started. Raises EngineError if it cannot be."""
        card = entry.card
        instances = InstanceSet()
        router = self._router(entry, key)
        if card.model_type is ModelType.TOKENS:
            if entry.tokenizer_sha256 is None:
                raise EngineError(f"token-level model {card.name!r} was registered without a tokenizer")
            card = await self._prepare(card, entry.tokenizer_sha256)
            engine = RemoteTokenEngine(
                card.name, instances, router, self.runtime, self.migration_limit,
                skip_special_tokens=entry.skip_special_tokens,
            )  # fmt: skip
            engine.lora_name = entry.lora.name if entry.lora is not None else None
            if entry.role == "prefill":
                engine.health = self._health(f"{card.name}/prefill")
            else:
                name = card.name
                engine.health = self._health(name)
                engine.prefill_pool = lambda: self._prefill_engine(name)
                engine.disagg = self.settings_for(entry).disagg
            token_model = TokenModel(card, engine)
            token_model.parent = entry.lora.base if entry.lora is not None else None
            return _Pool(token_model, engine, router, entry, key)
        text_engine = RemoteTextEngine(card.name, instances, router, self.runtime, self.migration_limit)
        text_engine.lora_name = entry.lora.name if entry.lora is not None else None
        text_engine.health = self._health(card.name)
        served = TextModel(
            card.name,
            text_engine,
            card.context_length or None,
            reasoning_parser=card.reasoning_parser,
            tool_call_parser=card.tool_call_parser,
            engine_name=card.engine,
        )
        served.parent = entry.lora.base if entry.lora is not None else None
        return _Pool(served, text_engine, router, entry, key)

    def settings_for(self, entry: ModelEntry) -> RouterSettings:
        """How to route ``entry``'s model: the settings its worker registered (its pipeline's), else this
        gateway's own. Raises ValueError for registered settings no router takes."""
        registered = entry.router
        if registered is None:
            return self.router_settings
        return dataclasses.replace(
            self.router_settings,
            mode=RouterMode(registered.mode),
            overlap_score_weight=registered.overlap_score_weight,
            queued_prefill_weight=registered.queued_prefill_weight,
            temperature=registered.temperature,
            use_kv_events=registered.use_kv_events,
            host_hit_weight=registered.host_hit_weight,
            disk_hit_weight=registered.disk_hit_weight,
            disagg=DisaggPolicy(
                mode=DisaggMode(registered.disagg_policy),
                isl_threshold=registered.disagg_isl_threshold,
                isl_ratio=registered.disagg_isl_ratio,
                prefill_busy=registered.disagg_prefill_busy,
                decode_busy=registered.disagg_decode_busy,
            ),
        )

    def _router(self, entry: ModelEntry, key: str) -> Router:
        """The pool's router, listening on the component of the endpoint ``key`` was registered under."""
        address = endpoint_of_model_key(key)
        try:
            settings = self.settings_for(entry)
            block_size = entry.card.kv_cache_block_size
            health = self._health(entry.card.name)
            lora = entry.lora.id if entry.lora is not None else None
            return build_router(
                settings, block_size=block_size, nc=self.runtime.nc, address=address, health=health, lora_id=lora
            )
        except ValueError as exc:
            raise EngineError(f"model {entry.card.name!r} cannot be routed: {exc}") from exc

    def _health(self, model: str) -> RoutingHealth | None:
        """Where ``model``'s router and remote engine count what they repaired, chose and refused."""
        return self.metrics.for_routing(model) if self.metrics is not None else None

    async def _prepare(self, card: ModelCard, digest: str) -> ModelCard:
        """``card`` with its tokenizer (fetched and built, or kept from before) and chat template ready."""
        kept = self._tokenizers.pop(digest, None)
        if kept is None:
            tokenizer_json, tokenizer = await self.runtime.fetch_tokenizer(digest), None
        else:
            tokenizer_json, tokenizer = kept
        # On a thread: the template's compilation and the vocabulary scan (~30 ms) let the event loop in
        # every few ms there. Tokenizer.from_str holds the GIL throughout; hence the tokenizers kept.
        card = msgspec.structs.replace(card, tokenizer_json=tokenizer_json)
        card = await asyncio.to_thread(card.prepare, tokenizer)
        self._tokenizers[digest] = (tokenizer_json, card.tokenizer)
        while len(self._tokenizers) > TOKENIZERS_KEPT:
            del self._tokenizers[next(iter(self._tokenizers))]
        return card


def endpoint_of_model_key(key: str) -> EndpointAddress | None:
    """The endpoint of ``flotilla/models/{ns}/{comp}/{ep}/{id}`` (or ``.../{id}/lora/{adapter}``, an adapter the
    instance serves: runtime/cluster/discovery.py), or None for a key not of that shape."""
    parts = key.removeprefix(MODELS_PREFIX).split("/")
    adapter = len(parts) >= 6 and parts[4] == ADAPTER_KEY_PART
    if not key.startswith(MODELS_PREFIX) or not (len(parts) == 4 or adapter):
        return None
    try:
        return EndpointAddress(*parts[:3])
    except FlotillaError:
        return None


async def _close_router(pool: _Pool) -> None:
    """Close ``pool``'s router; a failure is logged, never raised (the pool is going either way)."""
    try:
        await pool.router.close()
    except Exception:
        log.exception("closing the router of model %r failed", pool.served.name)
