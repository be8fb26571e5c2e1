"""LoRA adapters on llama.cpp, as llama.cpp loads them: a LoRA GGUF (``convert_lora_to_gguf.py``'s output, or
one made for the model) read by ``llama_adapter_lora_init(model, path)``, which checks it against the model
(architecture, tensor shapes) and returns NULL when it does not fit; ``llama_adapter_lora_free`` frees it.
Loading and freeing run on the engine thread, between two steps (``BatchScheduler.call``), where no decode can
use the adapter. llama.cpp sets adapters on a whole context (``llama_set_adapters_lora``): how the steps are
shared between adapters is engines/llamacpp/batch.py's.

llama.cpp needs nothing at start to take adapters, so a llama.cpp worker always can; it holds at most
``max_loras`` (``DEFAULT_MAX_LORAS`` unless ``--max-loras`` says), each in memory beside the model.
"""

import logging
from pathlib import Path
from typing import Any

from engines.llamacpp.batch import BatchScheduler
from runtime.errors import EngineError

log = logging.getLogger(__name__)

#: How many adapters a llama.cpp worker holds where ``--max-loras`` does not say.
DEFAULT_MAX_LORAS = 8


def load_adapter(scheduler: BatchScheduler, model: Any, name: str, path: Path) -> None:
    """On the engine thread: load the LoRA GGUF ``path`` for ``model`` as ``name`` (replacing one of that name).
    Raises EngineError when llama.cpp refuses it."""
    import llama_cpp

    adapter = llama_cpp.llama_adapter_lora_init(model.model, str(path).encode())
    if not adapter:
        raise EngineError(
            f"llama.cpp could not load adapter {name!r} from {str(path)!r}: not a LoRA GGUF of this model "
            "(llama.cpp checks its architecture and tensor shapes; its log says which)"
        )
    if name in scheduler.adapters:
        free_adapter(scheduler.drop_adapter(name))
    scheduler.adapters[name] = adapter


def unload_adapter(scheduler: BatchScheduler, name: str) -> None:
    """On the engine thread: end ``name``'s requests, forget its cached cells and free it."""
    free_adapter(scheduler.drop_adapter(name))


def free_adapter(adapter: Any) -> None:
    if adapter:
        import llama_cpp

        llama_cpp.llama_adapter_lora_free(adapter)
