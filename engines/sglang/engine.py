"""The SGLang engine (``sglang.Engine``, in the worker process): token ids in, token ids out, on GPUs.

SGLang runs with ``skip_tokenizer_init=True``: Flotilla's preprocessor templates and tokenizes, the
request goes in as ``input_ids`` and the stream comes back as ``output_ids``, so routing, migration,
stop strings and usage behave as for every token engine. ``async_generate(..., stream=True)`` yields
dicts ``{"output_ids": [...], "meta_info": {"id", "finish_reason", "completion_tokens",
"cached_tokens", ...}}``; whether ``output_ids`` holds the whole output so far or only the new tokens
depends on SGLang's ``incremental_streaming_output`` (Flotilla sets it: the whole list in every chunk is
quadratic in the answer), so the new tokens are the last ``completion_tokens - already sent`` of them, which
is right either way. What SGLang's checks refuse (its ``ValueError``) is RequestRejected, a 400 with its words;
what it cannot follow with ``skip_tokenizer_init`` (``min_tokens``) is refused before it (engines/sglang/requests.py,
which maps sampling, guided decoding and log probabilities).

Cancellation: each request goes in with its own ``rid``; when the consumer stops (a stop string, a client gone,
``context.stop()``), whether SGLang has answered yet or not (queued, prefilling), the request is aborted by it,
which frees its KV cache, and aborted again while SGLang still holds it (engines/sglang/aborts.py). SGLang's own
SIGTERM handler is kept from replacing the worker's drain (engines/sglang/signals.py).

The GPU share: SGLang's ``mem_fraction_static`` (weights and KV pool) is the memory share the control
plane placed the worker by (``--gpu-memory-utilization``); ``--tensor-parallel-size`` is ``tp_size``,
``--base-gpu-id`` ``base_gpu_id``, ``--context-length`` ``context_length``; ``--num-nodes``, ``--node-rank`` and
``--leader-addr`` are ``nnodes``, ``node_rank`` and ``dist_init_addr`` (a rank above 0 runs
engines/sglang/follower.py, not this engine). Other ServerArgs come from
``--extra-engine-args`` (JSON), checked against the names in ``SERVER_ARGS`` below.

KV events: SGLang publishes them over ZMQ (``kv_events_config``); the worker subscribes and renames the
blocks as Flotilla's router does (engines/shared/zmq_kv_events.py, engines/shared/engine_block_names.py). The block
size is SGLang's ``page_size``: Flotilla sets 16 where the extra arguments do not say (SGLang's own
default, 1, would name every token as a block), and takes the one SGLang settled on once started (it rewrites
it for some attention backends), which the model card then advertises. With data parallelism (``dp_size``,
attention DP or plain replicas) each rank has its own cache and publisher (on the base port plus its rank):
each of this node's ranks is subscribed to and reported as that dp rank, and routed to by it. Across nodes, the
ranks on the other nodes publish on theirs: each node relays its ranks' events over NATS and this worker hears
them as its own ranks' (engines/sglang/dp_relay.py).

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
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from engines.sglang.aborts import Aborts
from engines.sglang.disagg import (
    SGLANG_HANDOFF,
    bootstrap_address,
    bootstrap_arguments,
    disagg_engine_args,
    new_room,
)
from engines.sglang.dp_relay import RelayListener
from engines.sglang.hicache import hicache_tiers, host_total_blocks
from engines.sglang.lora import SglangAdapters, lora_server_args
from engines.sglang.requests import generate_arguments, sampling_params, token_logprobs
from engines.sglang.signals import start_handle_loop
from engines.shared.engine_block_names import EngineBlockNames
from engines.shared.extra_engine_args import check_arg_names, read_engine_args
from engines.shared.gpu_engine_args import GpuPlacement
from engines.shared.kv_tiers import tier_loads
from engines.shared.node_group import NodeGroup
from engines.shared.zmq_kv_events import ZmqSubscriber, free_tcp_ports, translate_batch
from runtime.engine import RequestContext
from runtime.errors import ConfigError, EngineError, ModelError, RequestRejected
from runtime.kv.events import BlockStored, KvEventSink, Medium, WorkerLoad
from runtime.kv.publisher import KvEventPublisher
from runtime.ports import ports_free
from runtime.protocol import DisaggRole, EngineOutput, FinishReason, KvHandoff, PreprocessedRequest

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

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
        "enable_lora", "lora_paths", "max_lora_rank", "max_loras_per_batch", "max_loaded_loras", "lora_backend",
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
#: The topic of the KV event publishers Flotilla starts SGLang with (its own and, relayed, a follower's).
KV_TOPIC = "flotilla-kv"
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
        if ports_free([port, *(port + offset for offset in DP_ATTENTION_PORT_OFFSETS)]):
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
    max_loras: int | None = None,
) -> dict[str, Any]:
    """The keyword arguments of ``sglang.Engine`` for this worker (rank ``nodes.node_rank`` of the nodes it spans);
    with ``max_loras``, LoRA enabled for that many adapters (engines/sglang/lora.py)."""
    kwargs: dict[str, Any] = {
        "model_path": str(model_path),
        "skip_tokenizer_init": True,
        "tp_size": placement.tensor_parallel_size,
        "base_gpu_id": placement.base_gpu_id,
        "page_size": DEFAULT_PAGE_SIZE,
        # Each chunk holds only its new tokens: SGLang's default copies the whole output list into every chunk,
        # quadratic in the answer's length (new_tokens reads either).
        "incremental_streaming_output": True,
        # SGLang's own metrics (sglang:*), which the worker's /metrics serves after its own (metrics.py); a
        # worker may turn them off with the engine argument.
        "enable_metrics": True,
        **engine_args,
    }
    if max_loras is not None:
        kwargs |= lora_server_args(engine_args, max_loras)
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
        kwargs["kv_events_config"] = json.dumps({"publisher": "zmq", "endpoint": kv_events_endpoint, "topic": KV_TOPIC})
    return kwargs


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


def local_dp_ranks(engine_args: dict[str, Any], nodes: NodeGroup | None = None) -> range:
    """The dp ranks whose KV cache (and event publisher) runs on this node: every ``dp_size`` replica, with
    attention DP (``enable_dp_attention``, one cache per rank) and without (plain DP: each replica a whole
    engine with its cache); across nodes, this node's share of them, as SGLang lays ranks out (Dynamo's
    ``DynamoSglangPublisher.init_kv_event_publish``: ``dp_size // nnodes`` per node, in node order)."""
    dp_size = max(int(engine_args.get("dp_size", 1) or 1), 1)
    if nodes is None or not nodes.spans_nodes or dp_size < nodes.num_nodes:
        return range(dp_size)
    local = dp_size // nodes.num_nodes
    return range(nodes.node_rank * local, (nodes.node_rank + 1) * local)


def relays_dp_events(engine_args: dict[str, Any], nodes: NodeGroup) -> bool:
    """Whether dp ranks publish their KV events on nodes other than the leader's: across nodes with at least a
    rank per node (with fewer, each rank spans nodes and its first, the leader's, publishes)."""
    dp_size = max(int(engine_args.get("dp_size", 1) or 1), 1)
    return nodes.spans_nodes and dp_size >= nodes.num_nodes


def remote_dp_ranks(engine_args: dict[str, Any], nodes: NodeGroup) -> range:
    """The dp ranks whose caches run on the other nodes of the leader's group, each relayed to it by its node
    (engines/sglang/dp_relay.py); none where every rank's events are published on the leader's node."""
    if not nodes.is_leader or not relays_dp_events(engine_args, nodes):
        return range(0)
    local = local_dp_ranks(engine_args, nodes)
    return range(local.stop, local.stop + len(local) * (nodes.num_nodes - 1))


def relayed_dp_ranks(engine_args: dict[str, Any], nodes: NodeGroup) -> range:
    """The dp ranks a node above rank 0 relays to the leader: those whose publishers run on it."""
    if nodes.is_leader or not relays_dp_events(engine_args, nodes):
        return range(0)
    return local_dp_ranks(engine_args, nodes)


def rank_endpoints(port: int, ranks: Sequence[int]) -> dict[int, str]:
    """Where each rank's publisher binds: SGLang adds the rank to the port of a tcp endpoint
    (``ZmqEventPublisher.offset_endpoint_port``; the replica's dp rank with plain DP, its attention-DP rank
    with attention DP: ``select_kv_publisher_dp_rank``)."""
    return {rank: f"tcp://*:{port + rank}" for rank in ranks}


def settled_page_size(engine: Any) -> int | None:
    """The page size SGLang settled on (``Engine.server_args.page_size``, after ``ServerArgs.__post_init__``
    rewrote it for the attention backend: 64 for FlashMLA, 128 for cutlass MLA...); None where it says none."""
    server_args = getattr(engine, "server_args", None) or getattr(
        getattr(engine, "tokenizer_manager", None), "server_args", None
    )
    page_size = getattr(server_args, "page_size", None)
    return int(page_size) if isinstance(page_size, int) and page_size > 0 else None


def _relay_ended(task: "asyncio.Task[None]") -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("the relayed KV events of the other nodes' dp ranks are no longer heard: %r", exc)


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
        *,
        lora: bool = False,
        max_loras: int | None = None,
    ) -> None:
        """``lora``: enable LoRA adapters (``load_lora``), as ``enable_lora`` in ``engine_args`` does;
        ``max_loras``: how many at once (SGLang's ``max_loaded_loras``; engines/sglang/lora.py). Raises ConfigError
        when ``engine_args`` set a disaggregation mode other than ``role``'s."""
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
        #: The dp ranks of this node, each a KV cache with its own event publisher (local_dp_ranks).
        self.dp_ranks = local_dp_ranks(engine_args, self.nodes)
        #: The dp ranks on the other nodes, whose events their nodes relay over NATS (engines/sglang/dp_relay.py).
        self.remote_ranks = remote_dp_ranks(engine_args, self.nodes)
        self._names = {rank: EngineBlockNames(self.block_size) for rank in self._event_ranks}
        self._sink: KvEventSink | None = None
        self.relay: RelayListener | None = None
        self._relay_task: asyncio.Task[None] | None = None
        self._subscribers: list[ZmqSubscriber] = []
        self._aborts: Aborts | None = None
        self._active = 0
        self._metrics_enabled = False
        self._metrics: CollectorRegistry | None = None
        #: The adapters loaded (None: LoRA not enabled).
        self.adapters = SglangAdapters.enabled(engine_args, lora=lora, max_loras=max_loras)

    @property
    def max_loras(self) -> int:
        """How many adapters it holds at once (0: LoRA not enabled)."""
        return self.adapters.book.max_loras if self.adapters is not None else 0

    async def load_lora(self, name: str, path: Path) -> None:
        if self.adapters is None:
            raise EngineError(f"cannot load adapter {name!r}: this SGLang worker was started without LoRA")
        await self.adapters.load(self._engine, name, path)

    async def unload_lora(self, name: str) -> None:
        if self.adapters is not None:
            await self.adapters.unload(self._engine, name)

    async def start(self) -> None:
        try:
            import sglang
        except ImportError as exc:
            raise ModelError(MISSING_PACKAGE) from exc
        # Rank r publishes on base + r (its global rank): the ports up to this node's last rank are kept free.
        base = free_tcp_ports(self.dp_ranks.stop)
        endpoints = rank_endpoints(base, self.dp_ranks)
        kwargs = engine_kwargs(
            self.model_path, self.placement, self.engine_args, kv_events_endpoint=f"tcp://*:{base}", nodes=self.nodes,
            port=dp_attention_port(self.engine_args, self.nodes),
            max_loras=self.max_loras or None,
        )  # fmt: skip
        try:
            # In this thread: SGLang's tokenizer manager binds to the running event loop.
            self._engine = sglang.Engine(**kwargs)
        except Exception as exc:  # SGLang raises what its model loader, CUDA or its arguments raise
            raise ModelError(f"SGLang could not load {self.model_path}: {exc}") from exc
        self._metrics_enabled = bool(kwargs.get("enable_metrics"))
        loop = asyncio.get_running_loop()
        self._settle_page_size()
        start_handle_loop(self._engine, loop)
        self._aborts = Aborts(self._engine)
        for rank, endpoint in endpoints.items():

            def on_batch(batch: Any, rank: int = rank) -> None:  # in the subscriber's thread
                loop.call_soon_threadsafe(self._publish_batch, rank, batch)

            self._subscribers.append(ZmqSubscriber(endpoint, KV_TOPIC, on_batch))
        log.info(
            "SGLang loaded %s (tp %d, KV pages of %d tokens)",
            self.model_path.name, self.placement.tensor_parallel_size, self.block_size,
        )  # fmt: skip

    def _settle_page_size(self) -> None:
        """Take the page size SGLang settled on as the KV block size (the card's, the events' names), where it
        rewrote the one it was given."""
        settled = settled_page_size(self._engine)
        if settled is None or settled == self.block_size:
            return
        log.info("SGLang settled on KV pages of %d tokens (it was given %d): blocks are named by %d", settled,
                 self.block_size, settled)  # fmt: skip
        self.block_size = settled
        self._names = {rank: EngineBlockNames(settled) for rank in self._event_ranks}

    @property
    def _event_ranks(self) -> list[int]:
        """Every dp rank whose KV events this worker names: its node's and, relayed, the other nodes'."""
        return [*self.dp_ranks, *self.remote_ranks]

    async def close(self) -> None:
        for task in list(self._prefills):
            task.cancel()
        await asyncio.gather(*self._prefills, return_exceptions=True)
        if self._aborts is not None:
            await self._aborts.close()
        for subscriber in self._subscribers:
            subscriber.close()
        if self._relay_task is not None:
            self._relay_task.cancel()
            await asyncio.gather(self._relay_task, return_exceptions=True)
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    def prometheus_registry(self) -> "CollectorRegistry | None":
        """The registry of SGLang's own metrics (``sglang:*``, engines/sglang/metrics.py), as its server's /metrics
        shows them; None before start, or with ``enable_metrics`` off."""
        if self._engine is None:
            return None
        if self._metrics is None:
            from engines.sglang.metrics import sglang_registry  # prometheus_client: only for a worker that serves it

            self._metrics = sglang_registry(self._metrics_enabled)
        return self._metrics

    def _publish_batch(self, rank: int, batch: Any) -> None:
        events = translate_batch(batch, self._names[rank])
        if events and self._sink is not None:
            self._sink.publish(rank, events)

    def attach_kv_events(self, sink: KvEventSink) -> None:
        """Publish KV events to ``sink``; where dp ranks run on other nodes, also hear their events, relayed over
        the NATS connection of the worker's publisher (the one sink that has one: a worker serving in=dyn://)."""
        self._sink = sink
        if not self.remote_ranks:
            return
        if not isinstance(sink, KvEventPublisher):
            log.warning(
                "the KV events of dp ranks %d-%d (on the other nodes) are relayed over NATS, which only a worker "
                "serving in=dyn:// hears: routers will not know their caches",
                self.remote_ranks.start, self.remote_ranks.stop - 1,
            )  # fmt: skip
            return
        assert self.nodes.leader is not None  # a group that spans nodes has one (NodeGroup checks)
        self.relay = RelayListener(sink.nc, sink.address, self.nodes.leader, self.remote_ranks, self._publish_batch)
        self._relay_task = asyncio.get_running_loop().create_task(self.relay.run(), name="SGLang relayed KV events")
        self._relay_task.add_done_callback(_relay_ended)

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
        reports = load_reports(
            snapshots, page_size=self.block_size, active=self._active, per_rank=len(self._event_ranks) > 1
        )
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
        params = sampling_params(request)  # RequestRejected before SGLang sees it
        if request.lora_name is not None:
            extra |= self._lora_arguments(request.lora_name)
        # SGLang's id for it: what an abort names, known before SGLang has sent anything (a client may leave while
        # the request waits in SGLang's queue). Unique per attempt: a migrated request may come back here while
        # SGLang still holds the first (SGLang refuses a duplicate rid).
        rid = f"{request.request_id}-{uuid.uuid4().hex[:8]}"
        finished = False
        sent = 0
        self._active += 1
        try:
            stream = await self._engine.async_generate(
                input_ids=request.token_ids, sampling_params=params, stream=True,
                **generate_arguments(request, rid), **extra,
            )  # fmt: skip
            async for chunk in stream:
                meta = chunk.get("meta_info", {})
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
                if request.logprobs is not None:
                    output.logprobs = token_logprobs(meta, len(tokens), request.logprobs)
                sent += len(tokens)
                if tokens or reason is not None:
                    yield output
                if reason is not None:
                    finished = True
                    return
        except ValueError as exc:
            # SGLang's checks of the request (TokenizerManager._validate_one_request, SamplingParams.verify: a
            # prompt over the context length, a bad sampling value, a grammar it cannot compile): the client's
            # error, a 400 with SGLang's words. Nothing runs in SGLang after it.
            finished = True
            raise RequestRejected(f"SGLang refused the request: {exc}") from exc
        finally:
            self._active -= 1
            if not finished and self._aborts is not None:
                # The client left, or the consumer stopped: queued, prefilling or decoding, SGLang frees it.
                self._aborts.abort(rid)

    def _lora_arguments(self, name: str) -> dict[str, Any]:
        """``async_generate``'s argument that runs a request with adapter ``name``: ``lora_path``, which SGLang
        resolves by the adapter's name (``TokenizerManager``'s ``lora_registry.acquire``). Raises EngineError
        where it is not loaded."""
        if self.adapters is None:
            raise EngineError(f"adapter {name!r} is not loaded: this SGLang worker was started without LoRA")
        self.adapters.book.require(name)
        return {"lora_path": name}

    async def _prefill(self, request: PreprocessedRequest, extra: dict[str, Any]) -> EngineOutput:
        """Start ``request``'s prefill in SGLang with a new room and answer its handoff at once; SGLang's stream
        runs on in a task of its own (the KV moves once the decode engine connects to the room)."""
        assert self.bootstrap is not None
        host, port = self.bootstrap
        params = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": new_room()}
        rid = f"{request.request_id}-{uuid.uuid4().hex[:8]}"
        if request.lora_name is not None:
            extra = extra | self._lora_arguments(request.lora_name)
        stream = await self._engine.async_generate(
            input_ids=request.token_ids, sampling_params=sampling_params(request), stream=True,
            **generate_arguments(request, rid), **extra, **params,
        )  # fmt: skip
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
