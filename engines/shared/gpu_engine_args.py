"""Where a GPU engine (SGLang, TensorRT-LLM) runs and how much it may take: the placement the control plane
reserved, from ``flotilla run``'s flags (their own arguments: extra_engine_args.py)."""

from dataclasses import dataclass

from runtime.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class GpuPlacement:
    """Where a GPU engine runs and how much it may take: from ``flotilla run``'s flags, which the node
    agent sets from what the control plane reserved."""

    #: GPUs one replica spans (tensor parallelism).
    tensor_parallel_size: int = 1
    #: The first of the (visible) GPUs the engine takes; the agent's CUDA_VISIBLE_DEVICES already names
    #: the reserved ones, so this is 0 under an agent.
    base_gpu_id: int = 0
    #: The context length Flotilla serves (None: the model's own).
    context_length: int | None = None
    #: The share of each GPU's memory the engine may take (0 < f <= 1); None: the library's default.
    gpu_memory_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor-parallel-size must be at least 1, not {self.tensor_parallel_size}")
        if self.base_gpu_id < 0:
            raise ConfigError(f"--base-gpu-id must be at least 0, not {self.base_gpu_id}")
        fraction = self.gpu_memory_fraction
        if fraction is not None and not 0 < fraction <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be above 0 and at most 1, not {fraction}")
