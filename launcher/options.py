"""The options of ``flotilla run`` once parsed: one typed object the composition reads."""

from dataclasses import dataclass, field
from pathlib import Path

from engines.shared.node_group import LeaderAddress, NodeGroup
from frontend_gateway.openai_api.image_limits import ImageLimits
from frontend_gateway.routing.disagg_policy import DisaggPolicy
from runtime.fleet_contract.engine_names import IMPLEMENTED_ENGINES, SETTINGS_FILE_ENGINES
from runtime.fleet_contract.router_settings import (
    DEFAULT_DISK_HIT_WEIGHT,
    DEFAULT_HOST_HIT_WEIGHT,
    DEFAULT_QUEUED_PREFILL_WEIGHT,
    PipelineRouter,
)
from runtime.http_head_deadline import DEFAULT_HEAD_TIMEOUT_S
from runtime.lora import LoraAdapter
from runtime.protocol import DisaggRole

# The engines (runtime/fleet_contract/engine_names.py), and the ingress.
ENGINES = (*IMPLEMENTED_ENGINES, "dyn")
# Engines configured by --extra-engine-args FILE.json.
EXTRA_ARGS_ENGINES = tuple(sorted(SETTINGS_FILE_ENGINES))

__all__ = ["ENGINES", "EXTRA_ARGS_ENGINES", "RunOptions"]


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    input: str = "text"  # "text", "http", "batch:FILE", "dyn://ns.comp.ep"
    output: str = "llamacpp"  # engine name
    model: str | None = None  # repo id, folder or GGUF file; None means the default model
    model_name: str | None = None
    model_config: Path | None = None
    context_length: int | None = None
    reasoning_parser: str | None = None  # frontend_gateway/parsers/reasoning.py, by vLLM's names
    tool_call_parser: str | None = None  # frontend_gateway/parsers/tool_calls.py
    http_host: str = "127.0.0.1"
    http_port: int = 8080
    max_body_bytes: int = 8 * 1024 * 1024
    allowed_origins: tuple[str, ...] = ()  # in=http: web origins whose pages may call the API (CORS)
    header_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S  # in=http: a request's headers arrive within this
    body_timeout_s: float = 60.0  # in=http: a request body arrives whole within this, else 408
    send_timeout_s: float = 60.0  # in=http: a client that takes none of its response this long is dropped
    image_limits: ImageLimits = field(default_factory=ImageLimits)  # in=http: chat requests' images
    threads: int | None = None
    parallel: int = 1  # out=llamacpp: slots decoded together (engines/llamacpp/batch.py)
    mmproj: Path | None = None  # out=llamacpp: a multimodal projector, for images (engines/llamacpp/vision.py)
    batch_concurrency: int = 4
    max_tokens: int | None = None
    temperature: float | None = None
    router_mode: str = "round-robin"  # "random", "round-robin" or "kv" (frontend_gateway/routing/)
    kv_overlap_score_weight: float = 1.0
    kv_queued_prefill_weight: float = DEFAULT_QUEUED_PREFILL_WEIGHT
    router_temperature: float = 0.0
    use_kv_events: bool = True
    kv_host_hit_weight: float = DEFAULT_HOST_HIT_WEIGHT  # credit of a host-memory (disk) prompt block hit
    kv_disk_hit_weight: float = DEFAULT_DISK_HIT_WEIGHT
    router_ttl_s: float = 120.0  # how long --use-kv-events false assumes a routed prefix stays cached
    busy_kv_usage: float | None = None  # --router-mode kv: busy thresholds (frontend_gateway/routing/)
    busy_waiting: int | None = None
    #: --router-mode kv: share routing decisions with the other ingress processes (routing/replica_sync.py).
    router_replica_sync: bool = True
    disagg_policy: DisaggPolicy = field(default_factory=DisaggPolicy)  # --disagg-*: where prompts are computed
    migration_limit: int = 0
    progress_deadline_s: float = 60.0  # out=dyn: FLOTILLA_STREAM_PROGRESS_DEADLINE_S (runtime/request_plane/)
    max_inflight: int = 4096  # admission control of in=http (frontend_gateway/admission.py)
    max_queued: int = 16384
    queue_timeout_s: float = 120.0
    reuse_port: bool = False  # several in=http processes on one port (SO_REUSEPORT)
    #: out=dyn: the control plane's API key signing secret; when set, /v1/* needs an API key.
    api_keys_secret_file: Path | None = None
    #: out=dyn with API keys: the Redis that every ingress shares keys' limits and usage through.
    tensor_parallel_size: int = 1  # out=vllm: GPUs the model is split across
    base_gpu_id: int | None = None  # out=vllm: the first GPU, among CUDA_VISIBLE_DEVICES when set
    gpu_memory_utilization: float | None = None  # out=vllm: the GPU memory share it may take (placement's)
    num_nodes: int = 1  # out=vllm, out=sglang: machines one engine instance spans (engines/shared/node_group.py)
    node_rank: int = 0  # this machine's among them: 0 serves, the others run their share of the model
    leader_addr: LeaderAddress | None = None  # where they meet (rank 0's machine), when num_nodes > 1
    quota_redis_url: str | None = None
    #: out=dyn with API keys: the cap on a key's concurrent requests per process, for keys that set none.
    max_concurrent_per_key: int | None = None
    #: out=dyn: the control plane's base URL, where /v1/files and /v1/batches are passed on.
    control_plane_url: str | None = None
    extra_engine_args: Path | str | None = None  # the engine's own settings (JSON), for EXTRA_ARGS_ENGINES
    labels: dict[str, str] = field(default_factory=dict)  # in=dyn: put into the worker's etcd registration
    disagg_role: DisaggRole = "aggregated"  # in=dyn: --disagg-role, the part of requests the worker serves
    metrics_port: int | None = None  # in=dyn: serve the worker's own /metrics on http_host:metrics_port
    #: in=dyn: the --router-* flags given to a worker, registered with its model (None: none was given).
    worker_router: PipelineRouter | None = None
    #: LoRA adapters to serve beside the model (--lora NAME=PATH), and the watched file of more (--lora-file).
    loras: tuple[LoraAdapter, ...] = ()
    lora_file: Path | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def serves_adapters(self) -> bool:
        """Whether LoRA adapters are given (``--lora`` or ``--lora-file``): the GPU engines then start with LoRA
        enabled (vLLM, SGLang and TensorRT-LLM reserve room for adapters only when asked)."""
        return bool(self.loras) or self.lora_file is not None

    @property
    def worker_address(self) -> str | None:
        """The dyn:// address to serve, for ``in=dyn://...``."""
        return self.input if self.input.startswith("dyn://") else None

    @property
    def node_group(self) -> NodeGroup:
        """The nodes the engine spans, this one's rank among them."""
        return NodeGroup(num_nodes=self.num_nodes, node_rank=self.node_rank, leader=self.leader_addr)

    @property
    def batch_file(self) -> Path | None:
        if self.input.startswith("batch:"):
            return Path(self.input.removeprefix("batch:"))
        return None
