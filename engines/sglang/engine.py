"""The SGLang engine (``sglang.Engine``, in the worker process): token ids in, token ids out, on GPUs.

SGLang runs with ``skip_tokenizer_init=True``: Flotilla's preprocessor templates and tokenizes, the
request goes in as ``input_ids`` and the stream comes back as ``output_ids``, so routing, migration,
stop strings and usage behave as for every token engine. ``async_generate(..., stream=True)`` yields
dicts ``{"output_ids": [...], "meta_info": {"id", "finish_reason", "completion_tokens",
"cached_tokens", ...}}``; whether ``output_ids`` holds the whole output so far or only the new tokens
depends on SGLang's ``incremental_streaming_output``, so the new tokens are the last
``completion_tokens - already sent`` of them, which is right either way.

Cancellation: when the consumer stops (a stop string, a client gone, ``context.stop()``), the request
is aborted in SGLang (``abort_request(rid)``), which frees its KV cache.

The GPU share: SGLang's ``mem_fraction_static`` (weights and KV pool) is the memory share the control
plane placed the worker by (``--gpu-memory-utilization``); ``--tensor-parallel-size`` is ``tp_size``,
``--base-gpu-id`` ``base_gpu_id``, ``--context-length`` ``context_length``; ``--num-nodes``, ``--node-rank`` and
``--leader-addr`` are ``nnodes``, ``node_rank`` and ``dist_init_addr`` (a rank above 0 runs
engines/sglang/follower.py, not this engine). Other ServerArgs come from
``--extra-engine-args`` (JSON), checked against the names in ``SERVER_ARGS`` below.

KV events: SGLang publishes them over ZMQ (``kv_events_config``); the worker subscribes and renames the
blocks as Flotilla's router does (engines/shared/zmq_kv_events.py, engines/shared/engine_block_names.py). The block
size is SGLang's ``page_size``: Flotilla sets 16 where the extra arguments do not say (SGLang's own
default, 1, would name every token as a block). With attention DP each rank has its own cache and
publisher (on the port after the previous rank's), subscribed to one by one and reported as that dp rank.

Load: each SGLang scheduler publishes a load snapshot per dp rank (running and waiting requests, KV
tokens used of the pool, token usage, prefix cache hit rate) to shared memory, which its tokenizer
manager reads for ``/v1/loads`` (``TokenizerManager.get_loads``); the worker reads the same snapshots
for its load reports, with the blocks counted in pages (``load_reports``). With the hierarchical cache
(``enable_hierarchical_cache``, engines/sglang/hicache.py) each report also has its tiers below the GPU: the
pages the events put on each, and the host pool's size.
"""

import asyncio
import json
import logging
import math
import random
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Literal

from engines.sglang.disagg import (
    SGLANG_HANDOFF,
    bootstrap_address,
    bootstrap_arguments,
    disagg_engine_args,
    new_room,
)
from engines.sglang.hicache import hicache_tiers, host_total_blocks
from engines.shared.engine_block_names import EngineBlockNames
from engines.shared.extra_engine_args import check_arg_names, read_engine_args
from engines.shared.gpu_engine_args import GpuPlacement
from engines.shared.kv_tiers import tier_loads
from engines.shared.node_group import NodeGroup
from engines.shared.zmq_kv_events import ZmqSubscriber, free_tcp_ports, loopback_ports_free, translate_batch
from runtime.engine import RequestContext
from runtime.errors import ConfigError, EngineError, ModelError
from runtime.kv.events import BlockStored, KvEventSink, Medium, WorkerLoad
from runtime.protocol import DisaggRole, EngineOutput, FinishReason, KvHandoff, PreprocessedRequest

log = logging.getLogger(__name__)

#: The one line a node without the package prints (exit 2).
MISSING_PACKAGE = "out=sglang needs the sglang package (and a CUDA GPU): pip install 'flotilla[sglang]'"

#: Where SERVER_ARGS were read, since SGLang does not import where the arguments are checked.
SERVER_ARGS_READ_FROM = "SGLang's ServerArgs (python/sglang/srt/server_args.py in sglang 0.5.15)"
#: The ServerArgs fields a worker may set in --extra-engine-args: those of the sections a serving worker
#: tunes (model, quantization, memory and scheduling, parallelism, kernels, LoRA, speculative decoding,
#: hierarchical cache, logging). Those Flotilla sets itself are in SET_BY_FLOTILLA.
SERVER_ARGS = frozenset(
    {
        # model and tokenizer
        "tokenizer_path", "tokenizer_mode", "load_format", "model_loader_extra_config", "trust_remote_code",
        "is_embedding", "revision", "model_impl", "json_model_override_args", "served_model_name",
        "download_dir",
        # quantization and data type
        "dtype", "quantization", "quantization_param_path", "kv_cache_dtype", "enable_fp32_lm_head",
        "modelopt_quant", "enable_tf32_matmul",
        # memory and scheduling
        "max_running_requests", "max_queued_requests", "max_total_tokens", "chunked_prefill_size",
        "max_prefill_tokens", "prefill_max_requests", "schedule_policy", "enable_priority_scheduling",
        "schedule_conservativeness", "page_size", "cpu_offload_gb", "enable_mixed_chunk",
        "num_continuous_decode_steps", "radix_eviction_policy", "disable_radix_cache",
        "stream_interval", "incremental_streaming_output",
        # parallelism
        "pp_size", "dp_size", "ep_size", "enable_dp_attention", "load_balance_method", "gpu_id_step",
        "dist_timeout",
        # kernels and runtime
        "attention_backend", "prefill_attention_backend", "decode_attention_backend", "sampling_backend",
        "grammar_backend", "disable_cuda_graph", "cuda_graph_backend_decode", "cuda_graph_backend_prefill",
        "cuda_graph_max_bs_decode", "cuda_graph_max_bs_prefill", "cuda_graph_bs_decode", "cuda_graph_bs_prefill",
        "enable_torch_compile",
        "torch_compile_max_bs", "moe_runner_backend", "moe_a2a_backend", "random_seed",
        "enable_deterministic_inference", "triton_attention_reduce_in_fp32",
        "watchdog_timeout", "device",
        # LoRA
        "enable_lora", "lora_paths", "max_lora_rank", "max_loras_per_batch", "lora_backend",
        "lora_target_modules",
        # speculative decoding
        "speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
        "speculative_eagle_topk", "speculative_num_draft_tokens",
        # hierarchical cache (host memory tier)
        "enable_hierarchical_cache", "hicache_ratio", "hicache_size", "hicache_write_policy",
        "hicache_io_backend", "hicache_mem_layout", "hicache_storage_backend", "hicache_storage_prefetch_policy",
        "hicache_storage_backend_extra_config",
        # logging and metrics
        "log_level", "enable_metrics", "show_time_cost", "decode_log_interval",
    }
)  # fmt: skip
#: ServerArgs Flotilla sets itself, and from what.
SET_BY_FLOTILLA = {
    "model_path": "from the MODEL argument",
    "tp_size": "from --tensor-parallel-size",
    "tensor_parallel_size": "from --tensor-parallel-size",
    "base_gpu_id": "from --base-gpu-id",
    "context_length": "from --context-length",
    "mem_fraction_static": "from --gpu-memory-utilization, the share the control plane placed the worker by",
    "skip_tokenizer_init": "always true: Flotilla tokenizes",
    "kv_events_config": "the worker subscribes to SGLang's KV events itself",
    "nnodes": "from --num-nodes",
    "node_rank": "from --node-rank",
    "dist_init_addr": "from --leader-addr",
    "port": "a free one per worker with enable_dp_attention (SGLang derives its processes' ports from it)",
}
#: SGLang's page size (tokens per KV block, the router's block size) where the arguments do not say.
DEFAULT_PAGE_SIZE = 16
_KV_TOPIC = "flotilla-kv"
#: With ``enable_dp_attention`` on one node, SGLang's processes talk over TCP on ports derived from
#: ServerArgs.port (default 30000): port + 233 to port + 239 (PortArgs.init_new). Two such workers on
#: one node would wait on each other's ports at the default, so each gets a free base. SGLang refuses
#: a port whose gRPC port (port + 10000) passes 65535.
DP_ATTENTION_PORT_OFFSETS = range(233, 240)
PORT_RANGE = range(20000, 65535 - 10000 + 1)


def parse_engine_args(raw: Path | str | None) -> dict[str, Any]:
    """The ServerArgs in ``--extra-engine-args`` (JSON). Raises ConfigError naming a key it refuses."""
    values = read_engine_args(raw, engine="sglang", syntax="json")
    check_arg_names(
        values, engine="sglang", documented=SERVER_ARGS, read_from=SERVER_ARGS_READ_FROM, set_by_flags=SET_BY_FLOTILLA
    )
    return values


def dp_attention_port(engine_args: dict[str, Any], nodes: NodeGroup | None, *, attempts: int = 50) -> int | None:
    """A ServerArgs.port whose derived dp-attention ports are free now, where SGLang derives them from it
    (``enable_dp_attention`` on one node; across nodes they come from --leader-addr); else None.
    Raises EngineError when no such port is found."""
    if not engine_args.get("enable_dp_attention") or (nodes is not None and nodes.spans_nodes):
        return None
    for _ in range(attempts):
        port = random.choice(PORT_RANGE)
        if loopback_ports_free([port, *(port + offset for offset in DP_ATTENTION_PORT_OFFSETS)]):
            return port
    raise EngineError("no free ports for SGLang's dp-attention processes on this node")


def engine_kwargs(
    model_path: Path,
    placement: GpuPlacement,
    engine_args: dict[str, Any],
    *,
    kv_events_endpoint: str | None,
    nodes: NodeGroup | None = None,
    port: int | None = None,
) -> dict[str, Any]:
    """The keyword arguments of ``sglang.Engine`` for this worker (rank ``nodes.node_rank`` of the nodes it spans)."""
    kwargs: dict[str, Any] = {
        "model_path": str(model_path),
        "skip_tokenizer_init": True,
        "tp_size": placement.tensor_parallel_size,
        "base_gpu_id": placement.base_gpu_id,
        "page_size": DEFAULT_PAGE_SIZE,
        **engine_args,
    }
    if placement.context_length is not None:
        kwargs["context_length"] = placement.context_length
    if placement.gpu_memory_fraction is not None:
        kwargs["mem_fraction_static"] = placement.gpu_memory_fraction
    if port is not None:
        kwargs["port"] = port
    if nodes is not None and nodes.spans_nodes and nodes.leader is not None:
        # tp_size counts the GPUs of every node; SGLang starts tp_size / nnodes of them here, from base_gpu_id.
        kwargs |= {"nnodes": nodes.num_nodes, "node_rank": nodes.node_rank, "dist_init_addr": str(nodes.leader)}
    if kv_events_endpoint is not None:
        kwargs["kv_events_config"] = json.dumps(
            {"publisher": "zmq", "endpoint": kv_events_endpoint, "topic": _KV_TOPIC}
        )
    return kwargs


def sampling_params(request: PreprocessedRequest) -> dict[str, Any]:
    """SGLang's ``sampling_params`` dict for ``request`` (SGLang's SamplingParams names); None options are
    left out, so that SGLang's defaults (the model's generation config) apply."""
    sampling, stop = request.sampling, request.stop_conditions
    params: dict[str, Any] = {
        # A prefill worker computes the prompt and the token its pass gives; the decode worker the rest.
        "max_new_tokens": 1 if request.prefill_only else stop.max_tokens,
        "min_new_tokens": 0 if request.prefill_only else stop.min_tokens,
        "ignore_eos": stop.ignore_eos,
        # Stop strings are the gateway's (they need text); SGLang stops on the model's EOS ids and these.
        "stop_token_ids": list(request.eos_token_ids),
    }
    optional = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        # OpenAI-style 0 means "no top-k"; SGLang spells that -1.
        "top_k": (sampling.top_k if sampling.top_k > 0 else -1) if sampling.top_k is not None else None,
        "min_p": sampling.min_p,
        "frequency_penalty": sampling.frequency_penalty,
        "presence_penalty": sampling.presence_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "sampling_seed": sampling.seed,
    }
    params.update({name: value for name, value in optional.items() if value is not None})
    return params


def finish_reason(meta_info: dict[str, Any]) -> FinishReason | None:
    """SGLang's ``meta_info["finish_reason"]`` (``{"type": "stop" | "length" | "abort", ...}``) as Flotilla's: an
    abort the worker did not ask for (it stops reading when it does) is SGLang refusing or failing the request."""
    reason = meta_info.get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind == "length":
        return "length"
    if kind == "abort":
        return "error"
    return "stop"


def abort_message(meta_info: dict[str, Any]) -> str:
    """What SGLang said when it aborted a request (``finish_reason["message"]``), or that it said nothing."""
    reason = meta_info.get("finish_reason")
    message = reason.get("message") if isinstance(reason, dict) else None
    return str(message) if message else "no reason given"


def new_tokens(chunk: dict[str, Any], sent: int) -> list[int]:
    """The tokens of ``chunk`` after the first ``sent`` of the request's output (cumulative or incremental
    ``output_ids`` alike: ``completion_tokens`` counts the whole output so far)."""
    output_ids: list[int] = chunk.get("output_ids") or []
    total = chunk.get("meta_info", {}).get("completion_tokens", sent + len(output_ids))
    fresh = max(total - sent, 0)
    return output_ids[len(output_ids) - fresh :] if fresh else []


def load_reports(snapshots: Sequence[Any], *, page_size: int, active: int, per_rank: bool) -> list[WorkerLoad]:
    """Flotilla's load reports from SGLang's load snapshots (``sglang.srt.managers.load_snapshot.LoadSnapshot``,
    one per dp rank, as ``/v1/loads`` reads them): one per rank with ``per_rank`` (attention DP: each rank
    is a cache the router routes to), else one for the instance, summed (plain DP replicas, which SGLang
    balances itself). Without any (SGLang has not published one yet), the requests this worker has in
    SGLang (``active``)."""
    if not snapshots:
        return [WorkerLoad(instance_id=0, active_requests=active)]
    groups = [[snapshot] for snapshot in snapshots] if per_rank else [list(snapshots)]
    reports = []
    for group in groups:
        running = sum(int(snapshot.num_running_reqs) for snapshot in group)
        waiting = sum(int(snapshot.num_waiting_reqs) for snapshot in group)
        used_tokens = sum(int(snapshot.num_used_tokens) for snapshot in group)
        total_tokens = sum(int(snapshot.max_total_num_tokens) for snapshot in group)
        reports.append(
            WorkerLoad(
                instance_id=0,
                dp_rank=int(group[0].dp_rank) if per_rank else 0,
                active_requests=running + waiting,
                running=running,
                waiting=waiting,
                kv_active_blocks=math.ceil(used_tokens / page_size),
                kv_total_blocks=total_tokens // page_size if total_tokens else None,
                # token_usage is the fullest of a scheduler's pools (KV, SWA, mamba): for a plain
                # transformer, its KV pool's share.
                kv_usage=_share(max(float(snapshot.token_usage) for snapshot in group)),
                prefix_hit_rate=_share(sum(float(snapshot.cache_hit_rate) for snapshot in group) / len(group)),
            )
        )
    return sorted(reports, key=lambda report: report.dp_rank)


def _share(value: float) -> float | None:
    """``value`` within 0..1 (what a report may say of a share); None for a value that is no number."""
    return min(max(value, 0.0), 1.0) if math.isfinite(value) else None


def attention_dp_ranks(engine_args: dict[str, Any]) -> int:
    """How many KV caches (and event publishers) SGLang runs: one per attention-DP rank with
    ``enable_dp_attention``, else one."""
    return int(engine_args.get("dp_size", 1)) if engine_args.get("enable_dp_attention") else 1


def rank_endpoints(port: int, ranks: int) -> list[str]:
    """Where each rank's publisher binds: SGLang adds the rank to the port of a tcp endpoint
    (``ZmqEventPublisher.offset_endpoint_port``)."""
    return [f"tcp://*:{port + rank}" for rank in range(ranks)]


class SglangEngine:
    """Token engine backed by ``sglang.Engine``. ``start()`` loads the model on the GPUs."""

    kind: Literal["token"] = "token"
    skip_special_tokens = True

    def __init__(
        self,
        model_path: Path,
        placement: GpuPlacement,
        engine_args: dict[str, Any],
        nodes: NodeGroup | None = None,
        role: DisaggRole = "aggregated",
    ) -> None:
        """Raises ConfigError when ``engine_args`` set a disaggregation mode other than ``role``'s."""
        self.model_path = model_path
        self.placement = placement
        self.role = role
        engine_args = disagg_engine_args(role, engine_args)
        self.engine_args = engine_args
        #: A prefill engine's bootstrap host and port, which its handoffs name.
        self.bootstrap = bootstrap_address(engine_args) if role == "prefill" else None
        #: The streams of prefills answered already (their handoff sent): SGLang's KV moves meanwhile.
        self._prefills: set[asyncio.Task[None]] = set()
        self.nodes = nodes or NodeGroup()
        self.block_size = int(engine_args.get("page_size", DEFAULT_PAGE_SIZE))
        self._engine: Any = None
        self._names = {rank: EngineBlockNames(self.block_size) for rank in range(attention_dp_ranks(engine_args))}
        self._sink: KvEventSink | None = None
        self._subscribers: list[ZmqSubscriber] = []
        self._active = 0

    async def start(self) -> None:
        try:
            import sglang
        except ImportError as exc:
            raise ModelError(MISSING_PACKAGE) from exc
        endpoints = rank_endpoints(free_tcp_ports(len(self._names)), len(self._names))
        kwargs = engine_kwargs(
            self.model_path, self.placement, self.engine_args, kv_events_endpoint=endpoints[0], nodes=self.nodes,
            port=dp_attention_port(self.engine_args, self.nodes),
        )  # fmt: skip
        try:
            # In this thread: SGLang's tokenizer manager binds to the running event loop.
            self._engine = sglang.Engine(**kwargs)
        except Exception as exc:  # SGLang raises what its model loader, CUDA or its arguments raise
            raise ModelError(f"SGLang could not load {self.model_path}: {exc}") from exc
        loop = asyncio.get_running_loop()
        for rank, endpoint in enumerate(endpoints):

            def on_batch(batch: Any, rank: int = rank) -> None:  # in the subscriber's thread
                loop.call_soon_threadsafe(self._publish_batch, rank, batch)

            self._subscribers.append(ZmqSubscriber(endpoint, _KV_TOPIC, on_batch))
        log.info("SGLang loaded %s (tp %d)", self.model_path.name, self.placement.tensor_parallel_size)

    async def close(self) -> None:
        for task in list(self._prefills):
            task.cancel()
        await asyncio.gather(*self._prefills, return_exceptions=True)
        for subscriber in self._subscribers:
            subscriber.close()
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    def _publish_batch(self, rank: int, batch: Any) -> None:
        events = translate_batch(batch, self._names[rank])
        if events and self._sink is not None:
            self._sink.publish(rank, events)

    def attach_kv_events(self, sink: KvEventSink) -> None:
        self._sink = sink

    def load(self) -> list[WorkerLoad]:
        """SGLang's own load snapshots (a read of shared memory, as ``/v1/loads`` does); the requests in
        flight only where SGLang has none to read."""
        snapshots: list[Any] = []
        reader = getattr(getattr(self._engine, "tokenizer_manager", None), "load_snapshot_reader", None)
        if reader is not None:
            try:
                snapshots = list(reader.read_all())
            except Exception as exc:  # a torn or missing shared-memory file: the next report reads again
                log.debug("SGLang's load snapshots could not be read: %r", exc)
        reports = load_reports(snapshots, page_size=self.block_size, active=self._active, per_rank=len(self._names) > 1)
        if offloads_to := hicache_tiers(self.engine_args):
            for report in reports:
                self._add_tiers(report, offloads_to)
        return reports

    def _add_tiers(self, report: WorkerLoad, offloads_to: tuple[Medium, ...]) -> None:
        """Set ``report.tiers``: each HiCache tier's pages held (from the rank's events) and the host pool's size."""
        names = self._names.get(report.dp_rank)
        if names is None:
            return
        device_tokens = (report.kv_total_blocks or 0) * self.block_size
        host = host_total_blocks(self.engine_args, device_tokens, self.block_size)
        report.tiers = tier_loads(names, offloads_to=offloads_to, total_blocks={"cpu": host})

    def cache_state(self, dp_rank: int | None) -> dict[int, list[BlockStored]]:
        return {rank: names.state() for rank, names in self._names.items() if dp_rank in (None, rank)}

    async def generate(self, request: PreprocessedRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        if self._engine is None:
            raise EngineError("the SGLang engine is not started")
        extra: dict[str, Any] = {}
        if request.dp_rank is not None:
            extra["data_parallel_rank"] = request.dp_rank
        if request.prefill_only and self.bootstrap is not None:
            yield await self._prefill(request, extra)
            return
        handoff = request.handoff
        if handoff is not None and handoff.kind == SGLANG_HANDOFF:
            try:
                extra |= bootstrap_arguments(handoff.params)
            except ConfigError as exc:
                raise EngineError(str(exc)) from exc
        rid: str | None = None
        finished = False
        sent = 0
        self._active += 1
        try:
            stream = await self._engine.async_generate(
                input_ids=request.token_ids, sampling_params=sampling_params(request), stream=True, **extra
            )
            async for chunk in stream:
                meta = chunk.get("meta_info", {})
                rid = meta.get("id", rid)
                if context.stopped:
                    return
                tokens = new_tokens(chunk, sent)
                reason = finish_reason(meta)
                if reason == "error":
                    finished = True  # SGLang ended it: nothing to abort
                    raise EngineError(f"SGLang aborted the request: {abort_message(meta)}")
                output = EngineOutput(token_ids=tokens, finish_reason=reason)
                if sent == 0 and (cached := meta.get("cached_tokens")) is not None:
                    output.cached_tokens = cached
                sent += len(tokens)
                if tokens or reason is not None:
                    yield output
                if reason is not None:
                    finished = True
                    return
        finally:
            self._active -= 1
            if not finished and rid is not None:
                abort_request(self._engine, rid)

    async def _prefill(self, request: PreprocessedRequest, extra: dict[str, Any]) -> EngineOutput:
        """Start ``request``'s prefill in SGLang with a new room and answer its handoff at once; SGLang's stream
        runs on in a task of its own (the KV moves once the decode engine connects to the room)."""
        assert self.bootstrap is not None
        host, port = self.bootstrap
        params = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": new_room()}
        stream = await self._engine.async_generate(
            input_ids=request.token_ids, sampling_params=sampling_params(request), stream=True, **extra, **params
        )
        task = asyncio.create_task(
            self._finish_prefill(stream, request.request_id), name=f"prefill {request.request_id}"
        )
        self._prefills.add(task)
        task.add_done_callback(self._prefills.discard)
        return EngineOutput([], "length", cached_tokens=0, handoff=KvHandoff(
            kind=SGLANG_HANDOFF, prompt_tokens=len(request.token_ids), params=params,
        ))  # fmt: skip

    async def _finish_prefill(self, stream: AsyncIterator[dict[str, Any]], request_id: str) -> None:
        """Read a prefill's SGLang stream to its end; a failure is logged (the decode half reports its own)."""
        try:
            async for chunk in stream:
                meta = chunk.get("meta_info", {})
                if finish_reason(meta) == "error":
                    log.warning("SGLang failed the prefill of request %s: %s", request_id, abort_message(meta))
        except Exception:
            log.exception("the prefill of request %s failed in SGLang", request_id)


def abort_request(engine: Any, rid: str) -> None:
    """Abort ``rid`` in SGLang (its KV cache is freed): ``Engine.abort_request`` where the version has it,
    else its tokenizer manager's."""
    abort = getattr(engine, "abort_request", None) or engine.tokenizer_manager.abort_request
    abort(rid)
