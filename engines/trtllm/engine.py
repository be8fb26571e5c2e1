"""The TensorRT-LLM engine (``tensorrt_llm.LLM``, its PyTorch backend, in the worker process): token ids
in, token ids out, on GPUs.

``LLM.generate_async({"prompt_token_ids": ids}, sampling_params, streaming=True)`` returns a
``RequestOutput`` to iterate with ``async for``; each step's ``outputs[0]`` carries the whole output so
far (``token_ids``) and ``finish_reason`` ("stop", "length", "cancelled") on the last. The LLM is made with
``skip_tokenizer_init=True`` and requests with ``detokenize=False``: Flotilla's preprocessor tokenizes
and its postprocessor detokenizes, as for every token engine.

Cancellation: ``RequestOutput.abort()`` when the consumer stops, which frees the request's KV blocks.

The GPU share: the KV cache's ``free_gpu_memory_fraction`` is computed from the memory share the control
plane placed the worker by (``--gpu-memory-utilization``; ``kv_cache_fraction`` says why it differs);
``--tensor-parallel-size`` is ``tensor_parallel_size``, ``--context-length`` ``max_seq_len``.
TensorRT-LLM takes no first-GPU index, so ``--base-gpu-id`` narrows CUDA_VISIBLE_DEVICES before the
library loads. Other LLM arguments come from ``--extra-engine-args``
(YAML, as ``trtllm-serve --extra_llm_api_options``), checked against the names in ``LLM_ARGS`` below.

KV events: ``KvCacheConfig(enable_block_reuse=True, event_buffer_max_size=...)`` keeps them, and a task reads
``get_kv_cache_events_async`` and renames the blocks as Flotilla's router does
(engines/trtllm/kv_events.py, engines/shared/engine_block_names.py), one names map per attention-DP rank. The
block size is the KV cache's ``tokens_per_block`` (32 unless the extra arguments' ``kv_cache_config`` says).

Load: another task reads ``get_stats_async`` (``enable_iter_perf_stats``) for each rank's running and waiting
requests, KV usage and prefix hit rate (engines/trtllm/stats.py).

Both tasks start after the first ``generate_async``, which creates the queues they read, and read for the
worker's life whatever TensorRT-LLM raises (engines/trtllm/readers.py).

Attention DP (``enable_attention_dp``): each of the ``tensor_parallel_size`` ranks has its own KV cache; a request
goes to the rank the router chose (``SchedulingParams(attention_dp_rank=..., attention_dp_relax=False)``, as
Dynamo's TensorRT-LLM worker passes it).

Refusals: ``generate_async`` checks a request before it queues it (``LLM._check_arguments``: a prompt over
``max_num_tokens`` without chunked prefill; ``LLM._prepare_sampling_params``: no end id and no tokenizer) and
raises ``ValueError``; the executor raises ``RequestError`` for a request it cannot take. Both are the client's
request, answered 400 with TensorRT-LLM's reason (RequestRejected).
"""

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

from engines.shared.engine_block_names import EngineBlockNames
from engines.shared.extra_engine_args import check_arg_names, read_engine_args
from engines.shared.gpu_engine_args import GpuPlacement
from engines.shared.grammar_constraints import grammar_constraint
from engines.shared.kv_tiers import tier_loads
from engines.trtllm.disagg import TRTLLM_HANDOFF, check_disagg_role, encode_params, generation_params
from engines.trtllm.gpu_memory import first_gpu_memory
from engines.trtllm.kv_events import FullAttentionPool, host_pool_blocks, translate_events
from engines.trtllm.lora import TrtLlmAdapters, lora_config, lora_config_class
from engines.trtllm.readers import read_for_good
from engines.trtllm.stats import StatsToLoad
from runtime.engine import RequestContext
from runtime.errors import ConfigError, EngineError, ModelError, RequestRejected
from runtime.kv.events import BlockStored, KvEventSink, WorkerLoad
from runtime.protocol import DisaggRole, EngineOutput, FinishReason, KvHandoff, PreprocessedRequest
from runtime.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)

#: The one line a node without the package prints (exit 2).
MISSING_PACKAGE = "out=trtllm needs the tensorrt_llm package (and a CUDA GPU): pip install 'flotilla[trtllm]'"

#: Where LLM_ARGS were read, since TensorRT-LLM does not import where the arguments are checked.
LLM_ARGS_READ_FROM = (
    "TensorRT-LLM 1.0's LLM arguments (TorchLlmArgs, as its API-stability references list them: "
    "tests/unittest/api_stability/references*/llm.yaml, NVIDIA/TensorRT-LLM 1.0.0rc4, commit 000a01de)"
)
#: The arguments of the PyTorch backend's ``LLM`` (TorchLlmArgs) a worker may set in --extra-engine-args: the
#: names TensorRT-LLM's own API-stability test holds ``LLM.__init__`` to, less those that take Python objects
#: (``batched_logits_processor``, ``checkpoint_loader``), the TensorRT-engine backend's ``build_config``, and
#: what Flotilla sets (SET_BY_FLOTILLA).
LLM_ARGS = frozenset(
    {
        # model and tokenizer
        "tokenizer", "tokenizer_mode", "trust_remote_code", "dtype", "revision", "tokenizer_revision",
        "load_format", "checkpoint_format", "reasoning_parser",
        # parallelism
        "pipeline_parallel_size", "context_parallel_size", "gpus_per_node", "moe_cluster_parallel_size",
        "moe_tensor_parallel_size", "moe_expert_parallel_size", "enable_attention_dp", "cp_config",
        # caches and scheduling
        "kv_cache_config", "kv_cache_dtype", "enable_chunked_prefill", "scheduler_config", "peft_cache_config",
        "cache_transceiver_config", "batching_type", "max_batch_size", "max_num_tokens", "max_input_len",
        "max_beam_width", "disable_overlap_scheduler",
        # LoRA, speculative decoding, structured output
        "enable_lora", "lora_config", "speculative_config", "guided_decoding_backend",
        # kernels and runtime
        "attn_backend", "moe_config", "cuda_graph_config", "torch_compile_config", "enable_autotuner",
        "enable_mixed_sampler", "enable_trtllm_sampler", "enable_min_latency", "force_dynamic_quantization",
        "allreduce_strategy", "garbage_collection_gen0_threshold", "num_postprocess_workers",
        "postprocess_tokenizer_dir", "normalize_log_probs", "gather_generation_logits", "stream_interval",
        # statistics
        "iter_stats_max_iterations", "request_stats_max_iterations", "enable_iter_perf_stats",
        "enable_iter_req_stats", "print_iter_log", "enable_layerwise_nvtx_marker",
    }
)  # fmt: skip
#: LLM arguments Flotilla sets itself, and from what.
SET_BY_FLOTILLA = {
    "model": "from the MODEL argument",
    "tensor_parallel_size": "from --tensor-parallel-size",
    "max_seq_len": "from --context-length",
    "skip_tokenizer_init": "always true: Flotilla tokenizes",
    "backend": "always the PyTorch backend",
}
#: kv_cache_config keys Flotilla sets itself (the rest of the user's kv_cache_config is kept).
KV_CACHE_SET_BY_FLOTILLA = {
    "free_gpu_memory_fraction": "from --gpu-memory-utilization, the share the control plane placed the worker by",
    "event_buffer_max_size": "the worker reads TensorRT-LLM's KV events itself",
}
#: TensorRT-LLM's tokens per KV block (the router's block size) where kv_cache_config does not say.
DEFAULT_TOKENS_PER_BLOCK = 32
#: KV events kept between two reads (TensorRT-LLM drops the oldest beyond it).
EVENT_BUFFER_MAX_SIZE = 16384
#: How long a read of the KV events or stats waits for the next item before its iterator ends.
READ_TIMEOUT_S = 1.0


def parse_engine_args(raw: Path | str | None) -> dict[str, Any]:
    """The LLM arguments in ``--extra-engine-args`` (YAML). Raises ConfigError naming a key it refuses."""
    values = read_engine_args(raw, engine="trtllm", syntax="yaml")
    check_arg_names(
        values, engine="trtllm", documented=LLM_ARGS, read_from=LLM_ARGS_READ_FROM, set_by_flags=SET_BY_FLOTILLA
    )
    kv_cache = values.get("kv_cache_config", {})
    if not isinstance(kv_cache, dict):
        raise ConfigError("--extra-engine-args: kv_cache_config must be a mapping of KvCacheConfig's fields")
    for key in kv_cache:
        if key in KV_CACHE_SET_BY_FLOTILLA:
            raise ConfigError(
                f"--extra-engine-args: kv_cache_config.{key} is set by Flotilla for out=trtllm "
                f"({KV_CACHE_SET_BY_FLOTILLA[key]})"
            )
    return values


def attention_dp_ranks(placement: GpuPlacement, engine_args: dict[str, Any]) -> int:
    """How many KV caches TensorRT-LLM runs: with ``enable_attention_dp`` each tensor-parallel rank is an
    attention-DP rank with its own (Dynamo's ``TensorRTLLMEngine.get_attention_dp_size``), else one."""
    return placement.tensor_parallel_size if engine_args.get("enable_attention_dp") else 1


def tokens_per_block(engine_args: dict[str, Any]) -> int:
    return int(engine_args.get("kv_cache_config", {}).get("tokens_per_block", DEFAULT_TOKENS_PER_BLOCK))


def llm_kwargs(
    model_path: Path, placement: GpuPlacement, engine_args: dict[str, Any], *, max_loras: int | None = None
) -> dict[str, Any]:
    """The keyword arguments of ``tensorrt_llm.LLM`` for this worker, with ``kv_cache_config`` as a dict of
    KvCacheConfig's fields (``start`` adds the memory share, measured on the GPU, and builds the
    KvCacheConfig); with ``max_loras``, ``lora_config`` as a dict of LoraConfig's for that many adapters
    (engines/trtllm/lora.py)."""
    kv_cache: dict[str, Any] = {
        "enable_block_reuse": True,
        **engine_args.get("kv_cache_config", {}),
        "event_buffer_max_size": EVENT_BUFFER_MAX_SIZE,
    }
    kwargs: dict[str, Any] = {
        # The iteration stats the worker's load reports come from (engines/trtllm/stats.py).
        "enable_iter_perf_stats": True,
        # Guided decoding (JSON schemas, regexes, grammars) needs a grammar backend chosen when the LLM is built.
        "guided_decoding_backend": "xgrammar",
        **engine_args,
        "model": str(model_path),
        "tensor_parallel_size": placement.tensor_parallel_size,
        "skip_tokenizer_init": True,
        "kv_cache_config": kv_cache,
    }
    if placement.context_length is not None:
        kwargs["max_seq_len"] = placement.context_length
    if max_loras is not None:
        kwargs["lora_config"] = lora_config(engine_args, max_loras)
    return kwargs


def kv_cache_fraction(share: float, *, total_bytes: int, free_bytes: int, weight_bytes: int) -> float:
    """TensorRT-LLM's ``free_gpu_memory_fraction`` that keeps the worker within ``share`` of a GPU's memory.

    TensorRT-LLM applies the fraction to the memory still free *after* it loaded the weights, while the
    control plane's share (and SGLang's, vLLM's) counts the weights in: passed as is, a 0.5 share of an
    80 GB GPU with 16 GB of weights would take 16 + 0.5 x 64 = 48 GB. So the KV budget is the share less
    the weights, over what will be free after them. Raises ConfigError when the weights alone exceed it.
    """
    budget = share * total_bytes - weight_bytes
    free_after_weights = free_bytes - weight_bytes
    if budget <= 0 or free_after_weights <= 0:
        raise ConfigError(
            f"--gpu-memory-utilization {share} gives {share * total_bytes / 2**30:.1f} GiB of each GPU, and the "
            f"weights alone take {weight_bytes / 2**30:.1f} GiB of it: give a larger share or more GPUs"
        )
    return min(budget / free_after_weights, 1.0)


def weight_bytes_per_gpu(model_path: Path, tensor_parallel_size: int) -> int:
    """The model's weights on each GPU: its safetensors files' size, split over the tensor-parallel GPUs."""
    files = model_path.glob("*.safetensors") if model_path.is_dir() else iter(())
    return sum(file.stat().st_size for file in files) // tensor_parallel_size


def visible_devices(current: str | None, base_gpu_id: int, count: int) -> str | None:
    """CUDA_VISIBLE_DEVICES narrowed to ``count`` GPUs from the ``base_gpu_id``-th visible one; None to leave
    it as it is (base 0). Raises ConfigError when fewer are visible."""
    if base_gpu_id == 0:
        return None
    visible = [name for name in current.split(",") if name] if current else None
    if visible is None:
        return ",".join(str(index) for index in range(base_gpu_id, base_gpu_id + count))
    if base_gpu_id + count > len(visible):
        raise ConfigError(
            f"--base-gpu-id {base_gpu_id} with --tensor-parallel-size {count} needs {base_gpu_id + count} visible "
            f"GPUs, and CUDA_VISIBLE_DEVICES names {len(visible)}"
        )
    return ",".join(visible[base_gpu_id : base_gpu_id + count])


def sampling_kwargs(request: PreprocessedRequest, guided_params: Any = None) -> dict[str, Any]:
    """TensorRT-LLM's ``SamplingParams`` arguments for ``request``; None options are left out (the
    library's defaults apply). A constraint becomes ``guided_decoding``, a ``guided_params``
    (``GuidedDecodingParams``: ``json``, ``regex`` or ``grammar``, a choice as its regex), followed by the LLM's
    grammar backend (xgrammar unless ``guided_decoding_backend`` says otherwise)."""
    sampling, stop = request.sampling, request.stop_conditions
    kwargs: dict[str, Any] = {
        # A prefill worker computes the prompt and the token its pass gives; the decode worker the rest.
        "max_tokens": 1 if request.prefill_only else stop.max_tokens,
        "min_tokens": 0 if request.prefill_only else stop.min_tokens,
        "ignore_eos": stop.ignore_eos,
        "detokenize": False,
    }
    if not stop.ignore_eos:
        # Stop strings are the gateway's (they need text); the engine stops on the model's EOS ids.
        kwargs["stop_token_ids"] = list(request.eos_token_ids)
    if request.eos_token_ids:
        kwargs["end_id"] = request.eos_token_ids[0]
    elif stop.ignore_eos:
        # Without its tokenizer TensorRT-LLM refuses a request without an end id (LLM._prepare_sampling_params),
        # and with ignore_eos it sends -1 in its place (BaseWorker._enqueue_request): say so at once.
        kwargs["end_id"] = -1
    optional = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        # OpenAI-style 0 (and -1) mean "no top-k"; TensorRT-LLM spells that 0.
        "top_k": max(sampling.top_k, 0) if sampling.top_k is not None else None,
        "min_p": sampling.min_p,
        "frequency_penalty": sampling.frequency_penalty,
        "presence_penalty": sampling.presence_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "seed": sampling.seed,
    }
    kwargs.update({name: value for name, value in optional.items() if value is not None})
    constraint = grammar_constraint(request) if not request.prefill_only else None
    if constraint is not None:
        if guided_params is None:
            raise EngineError("the TensorRT-LLM engine is not started")
        kind, text = constraint
        kwargs["guided_decoding"] = guided_params(**{kind: text})
    return kwargs


def finish_reason(reason: str | None) -> FinishReason | None:
    """TensorRT-LLM's ``CompletionOutput.finish_reason`` as Flotilla's."""
    if reason is None:
        return None
    if reason == "length":
        return "length"
    if reason == "cancelled":
        return "cancelled"
    if reason == "timeout":
        return "error"  # the request outlived TensorRT-LLM's allotted time: it ends unfinished
    return "stop"


class TrtLlmEngine:
    """Token engine backed by ``tensorrt_llm.LLM``. ``start()`` loads the model on the GPUs."""

    kind: Literal["token"] = "token"
    skip_special_tokens = True

    def __init__(
        self,
        model_path: Path,
        placement: GpuPlacement,
        engine_args: dict[str, Any],
        role: DisaggRole = "aggregated",
        *,
        lora: bool = False,
        max_loras: int | None = None,
    ) -> None:
        """``lora``: enable LoRA adapters (``load_lora``), as ``enable_lora`` or ``lora_config`` in ``engine_args``
        do; ``max_loras``: how many at once (``LoraConfig.max_loras``; engines/trtllm/lora.py). Raises ConfigError
        for a prefill or decode worker without a cache transceiver."""
        check_disagg_role(role, engine_args)
        self.model_path = model_path
        self.placement = placement
        self.role = role
        self.engine_args = engine_args
        self._disaggregated_params: Any = None  # TensorRT-LLM's DisaggregatedParams, once started
        self.block_size = tokens_per_block(engine_args)
        self._llm: Any = None
        self._sampling_params: Any = None
        self._guided_params: Any = None  # tensorrt_llm.llmapi.GuidedDecodingParams, once started
        self._scheduling_params: Any = None  # TensorRT-LLM's SchedulingParams, once started
        # What TensorRT-LLM raises for a request it refuses: ValueError from generate_async's checks, and its
        # executor's RequestError (tensorrt_llm/executor/utils.py, once started), then or while streaming.
        self._request_errors: tuple[type[Exception], ...] = ()
        self._names = {
            rank: EngineBlockNames(self.block_size) for rank in range(attention_dp_ranks(placement, engine_args))
        }
        self._pool = FullAttentionPool()
        self._odd_ranks = RateLimitedLog(log, period_s=60.0)
        self._sink: KvEventSink | None = None
        self._events_task: asyncio.Task[None] | None = None
        self._stats_task: asyncio.Task[None] | None = None
        self._stats = StatsToLoad()
        # Each rank's host (secondary) pool size in blocks, from its "created" KV event (kv_cache_config's
        # host_cache_size); absent: no host pool.
        self._host_blocks: dict[int, int] = {}
        self._active = 0
        #: The adapters requests may name (None: LoRA not enabled).
        self.adapters = TrtLlmAdapters.enabled(engine_args, lora=lora, max_loras=max_loras)

    @property
    def max_loras(self) -> int:
        """How many adapters it holds at once (0: LoRA not enabled)."""
        return self.adapters.book.max_loras if self.adapters is not None else 0

    async def load_lora(self, name: str, path: Path) -> None:
        if self.adapters is None:
            raise EngineError(f"cannot load adapter {name!r}: this TensorRT-LLM worker was started without LoRA")
        self.adapters.load(name, path)

    async def unload_lora(self, name: str) -> None:
        if self.adapters is not None:
            self.adapters.unload(name)

    async def start(self) -> None:
        devices = visible_devices(
            os.environ.get("CUDA_VISIBLE_DEVICES"), self.placement.base_gpu_id, self.placement.tensor_parallel_size
        )
        if devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = devices  # before the library sees CUDA
        try:
            from tensorrt_llm import LLM, SamplingParams
            from tensorrt_llm.executor.utils import RequestError
            from tensorrt_llm.llmapi import GuidedDecodingParams, KvCacheConfig
            from tensorrt_llm.scheduling_params import SchedulingParams
        except ImportError as exc:
            raise ModelError(MISSING_PACKAGE) from exc
        kwargs = llm_kwargs(self.model_path, self.placement, self.engine_args, max_loras=self.max_loras or None)
        if (share := self.placement.gpu_memory_fraction) is not None:
            # From NVML, not torch.cuda: a CUDA context here would hold GPU memory outside the share.
            free_bytes, total_bytes = first_gpu_memory(os.environ.get("CUDA_VISIBLE_DEVICES"))
            kwargs["kv_cache_config"]["free_gpu_memory_fraction"] = kv_cache_fraction(
                share,
                total_bytes=total_bytes,
                free_bytes=free_bytes,
                weight_bytes=weight_bytes_per_gpu(self.model_path, self.placement.tensor_parallel_size),
            )
        kwargs["kv_cache_config"] = KvCacheConfig(**kwargs["kv_cache_config"])
        if self.adapters is not None:
            kwargs["lora_config"] = lora_config_class()(**kwargs["lora_config"])
            self.adapters.start()
        try:
            # In this thread, as Dynamo's TensorRT-LLM worker does: the LLM starts its executor workers and
            # may install signal handlers, which only the main thread can.
            self._llm = LLM(**kwargs)
        except Exception as exc:  # TensorRT-LLM raises what its loader, CUDA or pydantic raise
            raise ModelError(f"TensorRT-LLM could not load {self.model_path}: {exc}") from exc
        self._sampling_params = SamplingParams
        self._guided_params = GuidedDecodingParams
        self._scheduling_params = SchedulingParams
        self._request_errors = (RequestError,)
        if self.role != "aggregated":
            from tensorrt_llm.llmapi import DisaggregatedParams

            self._disaggregated_params = DisaggregatedParams
        log.info("TensorRT-LLM loaded %s (tp %d)", self.model_path.name, self.placement.tensor_parallel_size)

    async def close(self) -> None:
        """Stop the readers and shut the LLM down (its MPI workers hold the GPUs' memory until then), whatever
        the readers did: a reader's error is logged here, not raised."""
        try:
            for task in (self._events_task, self._stats_task):
                if task is None:
                    continue
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                except Exception:
                    log.exception("TensorRT-LLM's %s reader had failed", task.get_name())
        finally:
            self._events_task = self._stats_task = None
            if self._llm is not None:
                llm, self._llm = self._llm, None
                await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)

    def _start_readers(self) -> None:
        """Start the KV-event and stats readers, once: after the first generate_async, which creates the
        executor's queues they read (engines/trtllm/readers.py)."""
        if self._events_task is not None or self._llm is None:
            return
        llm = self._llm

        def reading() -> bool:
            return self._llm is llm

        self._events_task = asyncio.create_task(
            read_for_good(
                "KV events",
                lambda: llm.get_kv_cache_events_async(timeout=READ_TIMEOUT_S),
                self._on_kv_event,
                reading=reading,
            ),
            name="trtllm kv events",
        )
        self._stats_task = asyncio.create_task(
            read_for_good(
                "iteration stats", lambda: llm.get_stats_async(timeout=READ_TIMEOUT_S), self._on_stats, reading=reading
            ),
            name="trtllm stats",
        )

    def _on_kv_event(self, event: dict[str, Any]) -> None:
        """Rename one of TensorRT-LLM's KV events and publish it (even before a sink is attached, the names map
        must hear every stored block)."""
        if not self._pool.keeps(event):
            return  # a sliding-window pool's: it says nothing of what the whole model has cached
        rank = event.get("attention_dp_rank") or 0
        if rank not in self._names:
            self._odd_ranks.warning(
                f"TensorRT-LLM sent a KV event of attention-DP rank {rank}, and the worker runs ranks "
                f"0..{len(self._names) - 1}: left out"
            )
            return
        if (host := host_pool_blocks(event)) is not None:
            self._host_blocks[rank] = host
        for each_rank, translated in translate_events([event], self._names).items():
            if self._sink is not None:
                self._sink.publish(each_rank, translated)

    def _on_stats(self, stat: dict[str, Any]) -> None:
        self._stats.update(stat)

    def attach_kv_events(self, sink: KvEventSink) -> None:
        self._sink = sink

    def load(self) -> list[WorkerLoad]:
        """Each rank's load from the LLM's latest iteration stats (with its host pool, where it has one); before
        the first, the requests taken."""
        if not self._stats.loads:
            return [WorkerLoad(instance_id=0, active_requests=self._active)]
        loads = [self._stats.loads[rank] for rank in sorted(self._stats.loads)]
        for load in loads:
            names, host = self._names.get(load.dp_rank), self._host_blocks.get(load.dp_rank)
            if names is not None:
                # The iteration stats count the GPU pool only: the host pool's use is what the events put there.
                load.tiers = tier_loads(names, offloads_to=("cpu",) if host else (), total_blocks={"cpu": host})
        return loads

    def cache_state(self, dp_rank: int | None) -> dict[int, list[BlockStored]]:
        return {rank: names.state() for rank, names in self._names.items() if dp_rank in (None, rank)}

    async def generate(self, request: PreprocessedRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        if self._llm is None:
            raise EngineError("the TensorRT-LLM engine is not started")
        params = self._sampling_params(**sampling_kwargs(request, self._guided_params))
        extra: dict[str, Any] = {}
        prefilling = request.prefill_only and self._disaggregated_params is not None
        if prefilling:
            extra["disaggregated_params"] = self._disaggregated_params(request_type="context_only")
        elif (handoff := request.handoff) is not None and handoff.kind == TRTLLM_HANDOFF:
            if self._disaggregated_params is None:
                raise EngineError("a TensorRT-LLM KV handoff reached a worker that is not a decode worker")
            try:
                extra["disaggregated_params"] = self._disaggregated_params(**generation_params(handoff.params))
            except ConfigError as exc:
                raise EngineError(str(exc)) from exc
        if request.lora_name is not None:
            if self.adapters is None:
                raise EngineError(f"adapter {request.lora_name!r} is not loaded: this worker was started without LoRA")
            extra["lora_request"] = self.adapters.request(request.lora_name)
        if (rank := self._scheduling_rank(request.dp_rank)) is not None:
            # Strict: the rank the router chose, whose cache it scored (relaxed, TensorRT-LLM may move it).
            extra["scheduling_params"] = self._scheduling_params(attention_dp_rank=rank, attention_dp_relax=False)
        refusals: tuple[type[Exception], ...] = (ValueError, *self._request_errors)
        try:
            result = self._llm.generate_async({"prompt_token_ids": request.token_ids}, params, streaming=True, **extra)
        except refusals as exc:
            raise RequestRejected(f"TensorRT-LLM refused the request: {exc}") from exc
        self._start_readers()
        finished = False
        sent = 0
        self._active += 1
        try:
            async for step in result:
                if context.stopped:
                    return
                completion = step.outputs[0]
                tokens = list(completion.token_ids[sent:])
                reason = finish_reason(completion.finish_reason)
                sent += len(tokens)
                output = EngineOutput(token_ids=tokens, finish_reason=reason)
                if prefilling and reason is not None:
                    output.handoff = KvHandoff(
                        kind=TRTLLM_HANDOFF,
                        prompt_tokens=len(request.token_ids),
                        params=encode_params(getattr(completion, "disaggregated_params", None)),
                    )
                if tokens or reason is not None:
                    yield output
                if reason is not None:
                    finished = True
                    return
        except self._request_errors as exc:
            # The executor's per-request error, raised while the result is read.
            raise RequestRejected(f"TensorRT-LLM refused the request: {exc}") from exc
        finally:
            self._active -= 1
            if not finished:
                result.abort()  # frees the request's KV blocks in TensorRT-LLM

    def _scheduling_rank(self, dp_rank: int | None) -> int | None:
        """The attention-DP rank to pin the request to: the router's choice, when this worker runs several."""
        if dp_rank is None or len(self._names) == 1:
            if dp_rank not in (None, 0):
                self._odd_ranks.warning(f"a request for dp rank {dp_rank} reached a worker without attention DP")
            return None
        if dp_rank not in self._names:
            self._odd_ranks.warning(
                f"a request for dp rank {dp_rank} reached a worker of ranks 0..{len(self._names) - 1}: "
                "TensorRT-LLM places it"
            )
            return None
        return dp_rank
