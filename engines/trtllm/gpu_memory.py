"""The worker's first GPU's free and total memory, read without opening a CUDA context.

The memory share becomes TensorRT-LLM's ``free_gpu_memory_fraction`` from the GPU's free and total memory
(engines/trtllm/engine.py, ``kv_cache_fraction``). Asking CUDA for them (``torch.cuda.mem_get_info``) would
open a CUDA context in the worker process, which TensorRT-LLM's executor does not use (its MPI workers run the
model): some hundreds of MiB of that GPU held for the worker's life, outside the share the control plane placed
it by. NVML (``nvidia-ml-py``, a Flotilla dependency) reads the same numbers from the driver without a context.
"""

from types import ModuleType
from typing import Any

from runtime.errors import ConfigError


def first_gpu_memory(visible_devices: str | None, *, nvml: ModuleType | None = None) -> tuple[int, int]:
    """Free and total bytes of the first GPU in ``visible_devices`` (CUDA_VISIBLE_DEVICES: indices, or
    ``GPU-``/``MIG-`` UUIDs; None or empty: GPU 0). Raises ConfigError when NVML cannot read it."""
    if nvml is None:
        import pynvml

        nvml = pynvml
    first = (visible_devices or "0").split(",")[0].strip()
    try:
        nvml.nvmlInit()
    except Exception as exc:  # pynvml.NVMLError: no driver, or no NVML library
        raise ConfigError(f"--gpu-memory-utilization needs the GPU's memory, and NVML cannot start: {exc}") from exc
    try:
        handle = _handle(nvml, first)
        memory: Any = nvml.nvmlDeviceGetMemoryInfo(handle)
        return int(memory.free), int(memory.total)
    except ConfigError:
        raise
    except Exception as exc:  # pynvml.NVMLError and its many subclasses
        raise ConfigError(f"NVML cannot read the memory of GPU {first!r} (CUDA_VISIBLE_DEVICES): {exc}") from exc
    finally:
        nvml.nvmlShutdown()


def _handle(nvml: ModuleType, device: str) -> Any:
    if device.startswith(("GPU-", "MIG-")):
        return nvml.nvmlDeviceGetHandleByUUID(device)
    if device.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(device))
    raise ConfigError(f"CUDA_VISIBLE_DEVICES names {device!r}, neither a GPU index nor a GPU- or MIG- UUID")
