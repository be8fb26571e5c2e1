"""The vLLM engine: vLLM's async engine (``AsyncLLM``) inside the worker process, token in, token out.

Flotilla's preprocessor renders and tokenizes; vLLM is given the token ids (``TokensPrompt``) and streams
the new ids of each step back (``RequestOutputKind.DELTA``), never text: Flotilla detokenizes and applies
stop strings, so routing, migration, stop handling and usage behave as for llama.cpp. A migrated stream
arrives as prompt + generated tokens; at temperature 0 vLLM's greedy continuation of them is the one the
dead worker would have produced (as far as vLLM's own batching is deterministic).

Cancellation: when the consumer stops (a stop string, a client gone, a cancelled task) the request is
aborted in vLLM (``AsyncLLM.abort``), which frees its KV blocks at once.

KV events: vLLM is started with a ZMQ KV event publisher on free loopback ports (``kv_events_config``), which
this process subscribes to. With data parallelism each rank's engine core publishes on the port after the
previous rank's (vLLM's ``ZmqEventPublisher.offset_endpoint_port``): every rank this node runs is subscribed
to, and its events, cache state and load are reported as that rank's. A ``kv_events_config`` given in
``--extra-engine-args`` is subscribed to in the same way when its publisher binds a TCP port here (else the
worker says that its router will hear nothing). Stored blocks are renamed with Flotilla's chained hash of their
token ids (engines/shared/engine_block_names.py), one map per rank, so that a KV router's names for a
request's blocks are the engine's; the maps answer removals and the routers' state asks. The engine is thus a
``KvEventSource``. A request goes to the rank the router chose (``dp_rank``, vLLM's ``data_parallel_rank``).

Disaggregated serving (docs/disaggregation.md): a ``prefill_only`` request runs with ``max_tokens`` 1 and ends
with a ``KvHandoff`` of what vLLM's KV connector returned (``kv_transfer_params``); a request with a vLLM handoff
gives those params back to the connector, which loads the prompt's KV. The connector is vLLM's own setting
(``kv_transfer_config``; engines/vllm/settings.py checks it fits the worker's role).

Load: ``load()`` reads vLLM's scheduler stats (running and waiting requests, KV usage, prefix hits) from
a stat logger the engine is built with. With KV offloading (``kv_offloading_size``, or the ``OffloadingConnector``:
engines/vllm/settings.py) the report has the host tier too: the blocks its events put there, and the share of
prompt tokens found there and not on the GPU (vLLM's ``connector_prefix_cache_stats``). vLLM's stats do not say
the host tier's size.
"""

import asyncio
import io
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

from engines.shared.engine_block_names import EngineBlockNames
from engines.shared.kv_tiers import tier_loads
from engines.shared.zmq_kv_events import ZmqSubscriber, free_tcp_ports, translate_batch
from engines.vllm.deferred_abort import PulledStream
from engines.vllm.lora import VllmAdapters, lora_engine_args
from engines.vllm.settings import MISSING_PACKAGE, VllmSettings, offload_tiers
from runtime.engine import RequestContext
from runtime.errors import ConfigError, EngineError, ModelError, RequestRejected
from runtime.kv.events import BlockStored, KvEventSink, WorkerLoad
from runtime.protocol import GUIDED_KINDS as ALL_GUIDED_KINDS
from runtime.protocol import EngineOutput, FinishReason, KvHandoff, PreprocessedRequest, TokenLogprob

log = logging.getLogger(__name__)

#: The topic of the KV event publisher Flotilla gives vLLM.
_KV_TOPIC = "flotilla-kv"
#: What the card says vLLM follows of guided decoding: all of it, by its structured outputs (``structured_outputs``).
GUIDED_KINDS = list(ALL_GUIDED_KINDS)
#: ``KvHandoff.kind`` of a vLLM prefill: a vLLM decode worker takes it (through its KV connector).
VLLM_HANDOFF = "vllm"


def visible_devices(current: str | None, base_gpu_id: int, count: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for ``count`` GPUs from ``base_gpu_id``: indexes into ``current`` (the GPUs
    this process was given, e.g. by the node agent) when set, else the machine's GPU indexes.

    Raises ConfigError when ``current`` has too few.
    """
    if current is None or not current.strip():
        return ",".join(str(index) for index in range(base_gpu_id, base_gpu_id + count))
    given = [name.strip() for name in current.split(",") if name.strip()]
    if base_gpu_id + count > len(given):
        raise ConfigError(
            f"--base-gpu-id {base_gpu_id} with --tensor-parallel-size {count} needs GPUs {base_gpu_id}.."
            f"{base_gpu_id + count - 1} of CUDA_VISIBLE_DEVICES={current!r}, which has {len(given)}"
        )
    return ",".join(given[base_gpu_id : base_gpu_id + count])


class VllmEngine:
    """Token engine backed by vLLM's ``AsyncLLM``. ``start()`` loads the model (vLLM starts its engine core
    process); ``close()`` shuts it down."""

    kind: Literal["token"] = "token"
    skip_special_tokens = True

    def __init__(
        self, settings: VllmSettings, *, base_gpu_id: int | None = None, card_block_size: int | None = None
    ) -> None:
        self.settings = settings
        self.base_gpu_id = base_gpu_id
        #: The KV block size the model's card tells routers (None: whatever vLLM settles on).
        self.card_block_size = card_block_size
        self._engine: Any = None  # vllm.v1.engine.async_llm.AsyncLLM
        self._stats = _SchedulerStats()
        #: vLLM's block hashes -> Flotilla's, per dp rank this node runs, once started and subscribed.
        self._names: dict[int, EngineBlockNames] = {}
        self._sink: KvEventSink | None = None
        self._subscribers: list[ZmqSubscriber] = []
        lora = lora_engine_args(settings.extra, lora=settings.lora, max_loras=settings.max_loras)
        #: The adapters loaded (None: LoRA not enabled).
        self.adapters = VllmAdapters(lora["max_loras"]) if lora else None

    @property
    def max_loras(self) -> int:
        """How many adapters it holds at once, as vLLM's config says once started (0: LoRA not enabled)."""
        return self.adapters.book.max_loras if self.adapters is not None else 0

    async def load_lora(self, name: str, path: Path) -> None:
        if self.adapters is None:
            raise EngineError(f"cannot load adapter {name!r}: this vLLM worker was started without LoRA")
        await self.adapters.load(self._engine, name, path)

    async def unload_lora(self, name: str) -> None:
        if self.adapters is not None:
            await self.adapters.unload(self._engine, name)

    async def start(self) -> None:
        if self.base_gpu_id is not None:
            # Before vLLM is imported: torch reads it once, and vLLM's workers inherit it.
            current = os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices(current, self.base_gpu_id, self.settings.local_gpus)
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise ModelError(MISSING_PACKAGE) from exc
        kwargs = self.settings.engine_kwargs()
        if "kv_events_config" not in kwargs:
            from vllm.config import KVEventsConfig

            # A wildcard endpoint: vLLM's publishers bind it (rank r on its port + r), and this process connects.
            first_rank, ranks = local_dp_ranks(kwargs)
            base = free_tcp_ports(ranks) - first_rank  # this node's ranks publish on the free ports found
            kwargs["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{base}", topic=_KV_TOPIC
            )
        args = AsyncEngineArgs(**kwargs)
        try:
            self._engine = AsyncLLM.from_engine_args(args, stat_loggers=[self._stats.factory()])
        except Exception as exc:  # vLLM raises ValueError, RuntimeError, OSError... for a bad model or setting
            raise ModelError(f"vLLM could not load {self.settings.model}: {exc}") from exc
        if self.card_block_size is not None and self.block_size != self.card_block_size:
            settled = self.block_size
            await self.close()
            raise ConfigError(
                f"vLLM settled on KV blocks of {settled} tokens, and routers would name them by "
                f"{self.card_block_size}: give vLLM its block size, --extra-engine-args '{{\"block_size\": {settled}}}'"
            )
        if self.adapters is not None:
            self.adapters.settle(self._engine)
        self._subscribe(kwargs["kv_events_config"])
        log.info("vLLM loaded %s (KV block size %d)", self.settings.model, self.block_size)

    def _subscribe(self, config: Any) -> None:
        """Subscribe to the KV events of every dp rank this node runs, as ``config`` (vLLM's KVEventsConfig, or
        its fields as a dict) makes vLLM publish them."""
        fields = config if isinstance(config, dict) else vars(config)
        endpoints = rank_endpoints(fields, *self._settled_ranks())
        if not endpoints:
            log.warning(
                "vLLM's kv_events_config %s publishes no KV events this worker can subscribe to (a zmq publisher on "
                "a tcp:// port here is needed): KV routers will not hear this worker's cache",
                fields,
            )
            return
        loop = asyncio.get_running_loop()
        topic = str(fields.get("topic") or "")
        for rank, endpoint in endpoints.items():
            self._names[rank] = EngineBlockNames(self.block_size)

            def on_batch(batch: Any, rank: int = rank) -> None:  # in the subscriber's thread
                loop.call_soon_threadsafe(self._publish_batch, rank, batch)

            self._subscribers.append(ZmqSubscriber(endpoint, topic, on_batch))

    def connector_hit_tokens(self) -> int:
        """Prompt tokens vLLM's KV connector gave this engine (every dp rank) rather than it computing them: loaded
        from a prefill worker's handoff, or from an offload tier. Counted from its scheduler stats, after each
        step."""
        return sum(rank.connector_hits for rank in self._stats.ranks.values())

    def prometheus_registry(self) -> Any:
        """The registry of vLLM's own metrics (``vllm:*``, its ``PrometheusStatLogger``'s, in this process, where
        ``AsyncLLM`` runs), as its OpenAI server's /metrics reads it; None before start."""
        if self._engine is None:
            return None
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        return get_prometheus_registry()

    def _settled_ranks(self) -> tuple[int, int]:
        """The first dp rank this node runs and how many, as vLLM settled them."""
        config = self._engine.vllm_config.parallel_config
        local = int(getattr(config, "data_parallel_size_local", 1) or 1)
        first = int(getattr(config, "data_parallel_rank", 0) or 0) if local < int(config.data_parallel_size) else 0
        return first, local

    @property
    def block_size(self) -> int:
        """vLLM's KV block size, as it settled it (the card's, so that routers name blocks as vLLM does)."""
        if self._engine is None:
            raise EngineError("the vLLM engine is not started")
        return int(self._engine.vllm_config.cache_config.block_size)

    @property
    def prefill_token_capacity(self) -> int | None:
        """Prompt tokens vLLM computes in one step (its ``max_num_batched_tokens``, on every dp rank), as the
        worker registers it: ``--disagg-policy load`` counts a prefill worker busy against it. None before
        ``start``."""
        if self._engine is None:
            return None
        config = self._engine.vllm_config
        return int(config.scheduler_config.max_num_batched_tokens) * int(config.parallel_config.data_parallel_size)

    def _publish_batch(self, rank: int, batch: Any) -> None:
        """One batch of rank ``rank``'s events (the rank whose port it came on), renamed by that rank's map."""
        names = self._names.get(rank)
        if names is None or self._sink is None:
            return
        if events := translate_batch(batch, names):
            self._sink.publish(rank, events)

    def attach_kv_events(self, sink: KvEventSink) -> None:
        self._sink = sink

    def cache_state(self, dp_rank: int | None) -> dict[int, list[BlockStored]]:
        """The blocks vLLM reported and did not evict since this process subscribed: of rank ``dp_rank``, or of
        every rank this node runs (None)."""
        return {rank: names.state() for rank, names in self._names.items() if dp_rank in (None, rank)}

    async def close(self) -> None:
        subscribers, self._subscribers = self._subscribers, []
        for subscriber in subscribers:
            subscriber.close()
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    async def generate(self, request: PreprocessedRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        engine = self._engine
        if engine is None:
            raise EngineError("the vLLM engine is not started")
        from vllm.inputs import TokensPrompt

        try:
            from vllm.exceptions import VLLMClientError as refusal
        except ImportError:  # vLLM before its own error classes: its validation raised ValueError
            refusal = ValueError
        if context.stopped:
            return
        params = sampling_params(request)
        lora_request = None
        if request.lora_name is not None:
            if self.adapters is None:
                raise EngineError(f"adapter {request.lora_name!r} is not loaded: this worker was started without LoRA")
            lora_request = self.adapters.request(request.lora_name)
        handoff = request.handoff
        if handoff is not None and handoff.kind == VLLM_HANDOFF and handoff.params:
            # What the prefill worker's connector returned (NIXL: its blocks and where to pull them from).
            # A connector that finds the KV by the prompt alone (ExampleConnector, LMCache) needs none.
            params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": handoff.params}
        prompt = TokensPrompt(prompt_token_ids=list(request.token_ids))
        if request.images:
            # Decoded on a thread (milliseconds per image). Each image's uuid is the gateway's digest: vLLM names
            # its blocks with it (extra keys), and so does the router (runtime/kv/image_blocks.py).
            prompt["multi_modal_data"] = {"image": await asyncio.to_thread(decode_images, request)}
            prompt["multi_modal_uuids"] = {"image": [image.digest for image in request.images]}
        request_id = request.request_id
        first = True
        finished = False
        cached: int | None = None
        # The rank the router chose (its cache holds the prefix); None: vLLM's own balancing.
        stream = engine.generate(
            prompt, params, request_id, data_parallel_rank=request.dp_rank, lora_request=lora_request
        )
        # A decode request pulls its prompt's KV first: stopped before its first output, it is aborted only once
        # that output comes (deferred_abort.py says why).
        decoding = handoff is not None and handoff.kind == VLLM_HANDOFF
        pulled = PulledStream(stream, engine.abort, request_id) if decoding else None
        try:
            async for output in pulled or stream:
                if context.stopped:
                    return
                completion = output.outputs[0]
                finish = finish_reason(completion.finish_reason) if completion.finished() else None
                item = EngineOutput(token_ids=list(completion.token_ids), finish_reason=finish)
                if first:
                    item.cached_tokens = cached = output.num_cached_tokens
                    if request.images and output.prompt_token_ids is not None:
                        item.prompt_tokens = len(output.prompt_token_ids)  # each image widened to its features
                    first = False
                if request.prompt_logprobs is not None and output.prompt_logprobs:
                    # vLLM gives them all at once, with the first output after the prompt (DELTA outputs).
                    item.prompt_logprobs = prompt_token_logprobs(
                        request.token_ids, output.prompt_logprobs, request.prompt_logprobs
                    )
                if request.prefill_only and finish is not None:
                    # The prompt's KV is with the connector now (stored, or held for a pull): say how to find it.
                    item.handoff = KvHandoff(
                        kind=VLLM_HANDOFF,
                        prompt_tokens=len(request.token_ids),
                        cached_tokens=cached or 0,
                        params=getattr(output, "kv_transfer_params", None) or {},
                    )
                if request.logprobs is not None and completion.logprobs:
                    item.logprobs = token_logprobs(completion.token_ids, completion.logprobs, request.logprobs)
                if item.token_ids or finish is not None or item.prompt_logprobs is not None:
                    yield item
                if finish is not None or output.finished:
                    finished = True
                    return
        except (ValueError, refusal) as exc:
            # vLLM's validation of the request (a bad parameter, a regex or grammar its structured-outputs backend
            # cannot compile): the client's error, a 400.
            raise RequestRejected(f"vLLM refused the request: {exc}") from exc
        finally:
            context.stop()
            if pulled is not None:
                pulled.close(finished)
            else:
                await stream.aclose()
                if not finished:
                    # Frees its KV blocks now; aclose() alone would leave vLLM to notice at its next output.
                    await engine.abort(request_id)

    def load(self) -> list[WorkerLoad]:
        """vLLM's scheduler stats at its last step (``instance_id`` 0), one report per dp rank (each engine core's
        stat logger), with its offload tier's."""
        loads = []
        tiers = offload_tiers(self.settings.extra)
        for rank in sorted({0, *self._stats.ranks, *self._names}):
            stats = self._stats.rank(rank)
            load = stats.load(rank)
            if tiers and (names := self._names.get(rank)) is not None:
                rate = stats.connector_hit_rate()
                load.tiers = tier_loads(names, offloads_to=tiers, hit_rates=dict.fromkeys(tiers, rate))
            loads.append(load)
        return loads


def local_dp_ranks(kwargs: dict[str, Any]) -> tuple[int, int]:
    """The first dp rank this node runs and how many, from vLLM's engine arguments (before vLLM settles them:
    enough to choose their publishers' ports)."""
    size = int(kwargs.get("data_parallel_size") or 1)
    local = int(kwargs.get("data_parallel_size_local") or size)
    if local >= size:
        return 0, size
    return int(kwargs.get("data_parallel_start_rank") or kwargs.get("data_parallel_rank") or 0), local


def rank_endpoints(fields: dict[str, Any], first_rank: int, ranks: int) -> dict[int, str]:
    """Where this process connects to hear each of its node's dp ranks' KV events, as vLLM's ``KVEventsConfig``
    fields make them publish: a zmq publisher binding a tcp port on every address (``tcp://*:PORT``), rank r on PORT + r
    (``ZmqEventPublisher.offset_endpoint_port``). Empty when none can be heard here: events off, another
    publisher, an ipc/inproc endpoint, one that connects out to a subscriber elsewhere, or port 0 (the OS's)."""
    endpoint = str(fields.get("endpoint") or "")
    if not fields.get("enable_kv_cache_events") or fields.get("publisher") != "zmq":
        return {}
    if not endpoint.startswith("tcp://*:"):
        return {}
    port = endpoint.removeprefix("tcp://*:")
    if not port.isdigit() or int(port) == 0:
        return {}
    return {rank: f"tcp://127.0.0.1:{int(port) + rank}" for rank in range(first_rank, first_rank + ranks)}


def decode_images(request: PreprocessedRequest) -> list[Any]:
    """The request's images as RGB PIL images, as vLLM's processors take them. Raises RequestRejected for one that
    cannot be decoded (the gateway checked it; a worker of another Pillow version might still disagree)."""
    from PIL import Image

    images = []
    for number, image in enumerate(request.images or ()):
        try:
            with Image.open(io.BytesIO(image.data)) as opened:
                images.append(opened.convert("RGB"))
        except (OSError, SyntaxError, ValueError) as exc:
            raise RequestRejected(f"image {number} of the request cannot be decoded: {exc}") from exc
    return images


def sampling_params(request: PreprocessedRequest) -> Any:
    """vLLM's ``SamplingParams`` for ``request``: its sampling options and stop conditions, outputs as deltas
    of token ids (Flotilla detokenizes and applies stop strings)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sampling, stop = request.sampling, request.stop_conditions
    kwargs: dict[str, Any] = {
        "n": 1,
        # A prefill worker computes the prompt and the token its pass gives; the decode worker the rest.
        "max_tokens": 1 if request.prefill_only else stop.max_tokens,
        "min_tokens": 1 if request.prefill_only else stop.min_tokens,
        "ignore_eos": stop.ignore_eos,
        # The request's own end tokens (the chat template's) besides the model's EOS; ignore_eos ignores them
        # too, as llama.cpp and the mocker do.
        "stop_token_ids": [] if stop.ignore_eos else list(request.eos_token_ids),
        "seed": sampling.seed,
        "output_kind": RequestOutputKind.DELTA,
        "detokenize": False,
        "skip_special_tokens": False,
    }
    if sampling.temperature is not None:
        kwargs["temperature"] = sampling.temperature
    if sampling.top_p is not None:
        kwargs["top_p"] = sampling.top_p
    if sampling.top_k is not None:
        # OpenAI-style 0 and -1 both mean "no top-k"; vLLM spells that 0 (or -1).
        kwargs["top_k"] = max(sampling.top_k, 0)
    if sampling.min_p is not None:
        kwargs["min_p"] = sampling.min_p
    if sampling.frequency_penalty is not None:
        kwargs["frequency_penalty"] = sampling.frequency_penalty
    if sampling.presence_penalty is not None:
        kwargs["presence_penalty"] = sampling.presence_penalty
    if sampling.repetition_penalty is not None:
        kwargs["repetition_penalty"] = sampling.repetition_penalty
    if sampling.logit_bias:
        kwargs["logit_bias"] = sampling.logit_bias
    if request.logprobs is not None:
        kwargs["logprobs"] = request.logprobs
    if (constraint := structured_outputs(request)) is not None:
        from vllm.sampling_params import StructuredOutputsParams

        kwargs["structured_outputs"] = StructuredOutputsParams(**constraint)
    if request.prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = request.prompt_logprobs
    return SamplingParams(**kwargs)


def structured_outputs(request: PreprocessedRequest) -> dict[str, Any] | None:
    """The fields of vLLM's ``StructuredOutputsParams`` that hold ``request``'s answer to its constraint (a JSON
    schema, a regex, a choice or a grammar, with the JSON options); None: the answer is free.

    The gateway sends one constraint at most (vLLM refuses two); the backend that follows it (xgrammar, guidance,
    outlines) is the worker's (``--extra-engine-args '{"structured_outputs_config": {"backend": ...}}'``).
    """
    guided = request.guided
    if request.json_schema is None and guided is None:
        return None
    fields: dict[str, Any] = {}
    if request.json_schema is not None:
        fields["json"] = request.json_schema
    if guided is not None:
        for name in ("regex", "choice", "grammar", "whitespace_pattern"):
            if (value := getattr(guided, name)) is not None:
                fields[name] = value
        if guided.disable_any_whitespace:
            fields["disable_any_whitespace"] = True
        if guided.disable_additional_properties:
            fields["disable_additional_properties"] = True
    return fields


def token_logprobs(token_ids: Any, logprobs: Any, top: int) -> list[TokenLogprob]:
    """vLLM's per-token logprob dicts (token id -> Logprob, the sampled one included, ranked) as Flotilla's."""
    result: list[TokenLogprob] = []
    for token_id, ranked in zip(token_ids, logprobs, strict=False):
        sampled = ranked[token_id].logprob
        likeliest = sorted(ranked.items(), key=lambda item: item[1].rank)[:top] if top else []
        result.append(TokenLogprob(sampled, [(other, entry.logprob) for other, entry in likeliest]))
    return result


def prompt_token_logprobs(token_ids: list[int], prompt_logprobs: Any, top: int) -> list[TokenLogprob]:
    """vLLM's ``prompt_logprobs`` (None for the first token, then a dict per token: the prompt's token and the
    likeliest, ranked) as Flotilla's: one per prompt token after the first."""
    entries = list(prompt_logprobs)
    if entries and entries[0] is None:
        entries = entries[1:]
    return token_logprobs(token_ids[1:], entries, top)


def finish_reason(reason: str | None) -> FinishReason | None:
    """vLLM's finish reason ("stop", "length", "abort") as Flotilla's."""
    if reason is None:
        return None
    if reason == "length":
        return "length"
    if reason == "abort":
        return "cancelled"
    return "stop"


class _RankStats:
    """The last scheduler stats one engine core (a dp rank) recorded."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Prompt tokens that the KV connector (an offload tier) had of those the GPU's cache did not.
        self.connector_hits = 0
        self.generated_tokens = 0
        self.preemptions = 0

    def load(self, rank: int) -> WorkerLoad:
        hit_rate = self.prefix_hits / self.prefix_queries if self.prefix_queries else None
        return WorkerLoad(
            instance_id=0,
            dp_rank=rank,
            active_requests=self.running + self.waiting,
            running=self.running,
            waiting=self.waiting,
            kv_usage=self.kv_usage,
            prefix_hit_rate=hit_rate,
            generated_tokens=self.generated_tokens,
            preemptions=self.preemptions,
        )

    def connector_hit_rate(self) -> float | None:
        """The share of prompt tokens found on the offload tier (not on the GPU), as ``prefix_hit_rate`` counts
        the GPU's; None before any prompt."""
        return min(self.connector_hits / self.prefix_queries, 1.0) if self.prefix_queries else None


class _SchedulerStats:
    """The last scheduler stats of each engine core (dp rank), kept by the stat loggers vLLM calls after each step
    (one per engine index, which is the core's dp rank)."""

    def __init__(self) -> None:
        self.ranks: dict[int, _RankStats] = {}

    def rank(self, index: int) -> _RankStats:
        return self.ranks.setdefault(index, _RankStats())

    def factory(self) -> Any:
        """A vLLM stat logger factory (called with the VllmConfig and the engine index) feeding this."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        every = self

        class FlotillaStatLogger(StatLoggerBase):  # type: ignore[misc]  # vLLM's class is untyped here
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                self.stats = every.rank(engine_index)

            def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
                stats = self.stats
                if scheduler_stats is not None:
                    stats.running = scheduler_stats.num_running_reqs
                    stats.waiting = scheduler_stats.num_waiting_reqs
                    stats.kv_usage = scheduler_stats.kv_cache_usage
                    prefix = scheduler_stats.prefix_cache_stats
                    stats.prefix_queries += prefix.queries
                    stats.prefix_hits += prefix.hits
                    if (connector := getattr(scheduler_stats, "connector_prefix_cache_stats", None)) is not None:
                        stats.connector_hits += connector.hits
                if iteration_stats is not None:
                    stats.generated_tokens += iteration_stats.num_generation_tokens
                    stats.preemptions += iteration_stats.num_preempted_reqs

            def log_engine_initialized(self) -> None:
                pass

        return FlotillaStatLogger
