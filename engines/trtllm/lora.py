"""LoRA adapters on TensorRT-LLM's PyTorch backend, as TensorRT-LLM runs them (1.x).

TensorRT-LLM takes its LoRA setup when the ``LLM`` is built: ``lora_config`` (``LoraConfig``,
tensorrt_llm/lora_helper.py; tensorrt_llm/lora_manager.py in earlier 1.0 builds) with ``max_loras`` (adapters on
the GPU at once), ``max_cpu_loras`` (kept in host memory), ``max_lora_rank`` and ``lora_target_modules`` (its own
module names: with no ``lora_dir`` at start it cannot read them from an adapter, so Flotilla names the attention
and MLP projections, ``DEFAULT_TARGET_MODULES``, where the extra engine args' ``lora_config`` does not say).

It has no load call: an adapter is named on each request, ``generate_async(..., lora_request=LoRARequest(
lora_name, lora_int_id, lora_path))`` (tensorrt_llm/executor/request.py), and its executor loads the folder the
first time it sees ``lora_int_id`` and caches it by that id in its PEFT cache (LRU over ``max_loras`` /
``max_cpu_loras``). So ``load_lora`` checks the folder and keeps it, ``unload_lora`` forgets it (requests of it
already queued finish), and ``lora_int_id`` is ``lora_id(name)``, the number its KV events would carry: the
block hashes TensorRT-LLM computes mix the adapter's id in, so an adapter's blocks never match the base model's.

Since the cache is by id, a name cannot be loaded again from another folder in the same worker (TensorRT-LLM
would go on running the weights it cached first): that is refused, and needs a new name or a restart.
"""

from pathlib import Path
from typing import Any

from engines.shared.lora_adapters import LoadedAdapters
from runtime.errors import EngineError

#: TensorRT-LLM's names of the modules an adapter may touch (attention q/k/v and output, MLP up/down/gate).
DEFAULT_TARGET_MODULES = ["attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h", "mlp_gate"]
#: The largest adapter rank its buffers are sized for where ``lora_config`` does not say.
DEFAULT_MAX_LORA_RANK = 64
#: How many adapters a worker holds where neither ``--max-loras`` nor ``lora_config.max_loras`` says.
DEFAULT_MAX_LORAS = 8


def lora_config(engine_args: dict[str, Any], max_loras: int) -> dict[str, Any]:
    """``LoraConfig``'s fields for ``max_loras`` adapters loaded at run time, over the extra args' ``lora_config``."""
    given = dict(engine_args.get("lora_config") or {})
    config: dict[str, Any] = {
        "max_lora_rank": DEFAULT_MAX_LORA_RANK,
        "lora_target_modules": DEFAULT_TARGET_MODULES,
        **given,
        "max_loras": max_loras,
    }
    config.setdefault("max_cpu_loras", max_loras)
    return config


def lora_config_class() -> Any:
    """TensorRT-LLM's ``LoraConfig`` class, where this build keeps it."""
    try:
        from tensorrt_llm.lora_helper import LoraConfig
    except ImportError:
        from tensorrt_llm.lora_manager import LoraConfig
    return LoraConfig


class TrtLlmAdapters:
    """The adapters a TrtLlmEngine names on its requests."""

    def __init__(self, max_loras: int) -> None:
        self.book = LoadedAdapters("TensorRT-LLM", max_loras)
        self._request_class: Any = None  # tensorrt_llm's LoRARequest, once started
        #: Each name's folder as TensorRT-LLM may have cached it, for the worker's life (unloaded ones too).
        self._folders: dict[str, Path] = {}

    @classmethod
    def enabled(cls, engine_args: dict[str, Any], *, lora: bool, max_loras: int | None) -> "TrtLlmAdapters | None":
        """The adapters' book where LoRA is asked for (``lora``, ``max_loras``, or ``enable_lora`` /
        ``lora_config`` in the extra engine args), else None."""
        if not (lora or max_loras is not None or engine_args.get("enable_lora") or engine_args.get("lora_config")):
            return None
        configured = (engine_args.get("lora_config") or {}).get("max_loras")
        return cls(max_loras or int(configured or DEFAULT_MAX_LORAS))

    def start(self) -> None:
        """Import TensorRT-LLM's ``LoRARequest`` (once the library is loaded)."""
        try:
            from tensorrt_llm.executor.request import LoRARequest
        except ImportError:
            from tensorrt_llm.executor import LoRARequest
        self._request_class = LoRARequest

    def load(self, name: str, path: Path) -> None:
        """Keep ``name``'s folder for its requests. Raises EngineError (no such folder, too many adapters, a name
        TensorRT-LLM has cached from another folder)."""
        first = self._folders.get(name)
        if first is not None and first != path:
            raise EngineError(
                f"TensorRT-LLM cannot load adapter {name!r} from {str(path)!r}: this worker ran {name!r} from "
                f"{str(first)!r}, and TensorRT-LLM caches adapters by their id for the worker's life; serve the new "
                "weights under a new name, or restart the worker"
            )
        if self.book.plan(name, path) == "new":
            self.book.add(name, path)
            self._folders[name] = path

    def unload(self, name: str) -> None:
        """Forget ``name`` (TensorRT-LLM drops its cached weights as its PEFT cache needs the room). The name stays
        bound to its folder: loading it again from another one is refused (``load``)."""
        self.book.pop(name)

    def request(self, name: str | None) -> Any:
        """The ``lora_request`` for a request naming adapter ``name`` (None: the base model's, None). Raises
        EngineError for one not loaded."""
        adapter = self.book.require(name)
        if adapter is None:
            return None
        return self._request_class(lora_name=adapter.name, lora_int_id=adapter.id, lora_path=str(adapter.path))
