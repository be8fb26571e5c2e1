"""LoRA adapters on vLLM, as vLLM loads them at run time (``AsyncLLM``, vllm 0.32).

vLLM starts with LoRA when its engine args say ``enable_lora`` (Flotilla sets it when the worker is given adapters,
``VllmSettings.lora``, or ``--max-loras``; or the extra engine args say it); ``max_loras`` is how many adapters
vLLM runs at once (its LoRA slots on the GPU), ``max_lora_rank`` the largest rank it sizes them for (vLLM's
default, 16, unless the extra engine args say). Flotilla holds at most ``max_loras`` adapters, as vLLM's config
settles it, and gives vLLM ``DEFAULT_MAX_LORAS`` where neither ``--max-loras`` nor the extra args say (vLLM's own
default, 1, would hold one adapter).

``AsyncLLM.add_lora(LoRARequest(lora_name, lora_int_id, lora_path))`` loads one (``load_inplace=True`` replaces
the weights of an id loaded already: a name loaded again from another folder), ``remove_lora(lora_int_id)``
unloads it, and ``generate(..., lora_request=...)`` runs a request with it (vllm/v1/engine/async_llm.py;
vllm/lora/request.py). vLLM would load an adapter a request names even after ``remove_lora`` (the request carries
its path), so a request naming an adapter not loaded is refused here. ``lora_int_id`` is ``lora_id(name)``; vLLM's
KV events carry it (``BlockStored.lora_id`` is the request's ``lora_request.adapter_id``, its ``lora_int_id``:
vllm/v1/core/block_pool.py), and its block hashes mix the adapter in (its extra keys), so an adapter's blocks never
match the base model's.
"""

from pathlib import Path
from typing import Any

from engines.shared.lora_adapters import LoadedAdapters
from runtime.errors import EngineError
from runtime.lora import lora_id

#: How many adapters a worker holds where neither ``--max-loras`` nor the extra args' ``max_loras`` says.
DEFAULT_MAX_LORAS = 4


def lora_engine_args(extra: dict[str, Any], *, lora: bool, max_loras: int | None) -> dict[str, Any]:
    """The engine args that enable LoRA, where it is asked for (``lora``, ``max_loras``, ``enable_lora`` in
    ``extra``); else none."""
    if not (lora or max_loras is not None or extra.get("enable_lora")):
        return {}
    return {"enable_lora": True, "max_loras": max_loras or int(extra.get("max_loras") or DEFAULT_MAX_LORAS)}


class VllmAdapters:
    """The adapters a VllmEngine has loaded into vLLM."""

    def __init__(self, max_loras: int) -> None:
        self.book = LoadedAdapters("vLLM", max_loras)

    def settle(self, engine: Any) -> None:
        """Take the adapters' limit from vLLM's settled config (``vllm_config.lora_config.max_loras``)."""
        config = getattr(getattr(engine, "vllm_config", None), "lora_config", None)
        settled = getattr(config, "max_loras", None)
        if isinstance(settled, int) and settled > 0:
            self.book.max_loras = settled

    async def load(self, engine: Any, name: str, path: Path) -> None:
        """Load ``name`` from ``path`` into vLLM (``engine``: the started ``AsyncLLM``). Raises EngineError."""
        plan = self.book.plan(name, path)
        if plan == "loaded":
            return
        if engine is None:
            raise EngineError(f"cannot load adapter {name!r}: the vLLM engine is not started")
        from vllm.lora.request import LoRARequest

        request = LoRARequest(name, lora_id(name), str(path), load_inplace=plan == "reload")
        try:
            added = await engine.add_lora(request)
        except Exception as exc:  # vLLM raises ValueError, OSError, RuntimeError... for an adapter it cannot load
            raise EngineError(f"vLLM could not load adapter {name!r} from {str(path)!r}: {exc}") from exc
        if added is False and plan == "new":
            raise EngineError(f"vLLM could not load adapter {name!r} from {str(path)!r} (add_lora said no)")
        self.book.add(name, path)

    async def unload(self, engine: Any, name: str) -> None:
        """Unload ``name`` from vLLM; nothing where it is not loaded. Requests of it already running finish."""
        adapter = self.book.pop(name)
        if adapter is None or engine is None:
            return
        try:
            await engine.remove_lora(adapter.id)
        except Exception as exc:
            raise EngineError(f"vLLM could not unload adapter {name!r}: {exc}") from exc

    def request(self, name: str) -> Any:
        """vLLM's ``lora_request`` for a request naming ``name``. Raises EngineError for one not loaded."""
        from vllm.lora.request import LoRARequest

        adapter = self.book.require(name)
        assert adapter is not None
        return LoRARequest(adapter.name, adapter.id, str(adapter.path))
