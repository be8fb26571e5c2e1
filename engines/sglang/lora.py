"""LoRA adapters on SGLang, as SGLang loads them at run time (sglang 0.5.15).

SGLang starts with LoRA when its ServerArgs say ``enable_lora`` (Flotilla sets it when the worker is given
adapters, ``lora=True``, or ``--max-loras``); with no ``lora_paths`` at start it must be told the largest rank and
the modules the adapters will touch, since it sizes its LoRA buffers once: Flotilla sets ``max_lora_rank``
``DEFAULT_MAX_LORA_RANK`` and ``lora_target_modules`` ``["all"]`` where the extra engine args do not say.
``max_loaded_loras`` (how many SGLang holds; a load past it is refused) is the worker's ``max_loras``, and
``max_loras_per_batch`` (how many may run in one batch, SGLang's default 8) is kept at or under it, as SGLang
requires.

Loading and unloading go through the tokenizer manager, on the worker's event loop (``Engine.load_lora_adapter``
is a blocking ``loop.run_until_complete`` of the same call, which cannot run inside a running loop):
``TokenizerManager.load_lora_adapter(LoadLoRAAdapterReqInput(lora_name, lora_path), None)`` answers a
``LoadLoRAAdapterReqOutput`` (``success``, ``error_message``); ``unload_lora_adapter(UnloadLoRAAdapterReqInput(
lora_name))`` unregisters the name first (no new request starts with it) and waits for its running requests
before the scheduler frees it (python/sglang/srt/managers/tokenizer_manager.py; io_struct.py). A request runs
with an adapter when ``async_generate`` is given ``lora_path=<its name>``.

KV events: SGLang's radix cache keys an adapter's pages apart from the base model's, but its events say
``lora_id=None`` and name pages by their tokens alone (``RadixCache._record_store_event``), so the worker cannot
tell an adapter's blocks from the base model's: they are reported as the base model's (docs/engines.md says what
that costs: a KV router may overrate a worker's overlap for a prompt some adapter ran).
"""

from pathlib import Path
from typing import Any

from engines.shared.lora_adapters import LoadedAdapters
from runtime.errors import EngineError

#: The largest adapter rank SGLang sizes its buffers for when no adapter is given at start (extra engine args'
#: ``max_lora_rank`` overrides it).
DEFAULT_MAX_LORA_RANK = 64
#: SGLang's ``max_loras_per_batch`` default.
SGLANG_MAX_LORAS_PER_BATCH = 8
#: How many adapters a worker holds where neither ``--max-loras`` nor ``max_loaded_loras`` says.
DEFAULT_MAX_LORAS = 8


def lora_server_args(engine_args: dict[str, Any], max_loras: int) -> dict[str, Any]:
    """The ServerArgs that enable LoRA for ``max_loras`` adapters loaded at run time, over ``engine_args``'s."""
    args: dict[str, Any] = {"enable_lora": True, "max_loaded_loras": max_loras}
    args["max_loras_per_batch"] = min(
        int(engine_args.get("max_loras_per_batch", SGLANG_MAX_LORAS_PER_BATCH)), max_loras
    )
    if not engine_args.get("lora_paths"):
        args["max_lora_rank"] = engine_args.get("max_lora_rank", DEFAULT_MAX_LORA_RANK)
        args["lora_target_modules"] = engine_args.get("lora_target_modules", ["all"])
    return args


class SglangAdapters:
    """The adapters an SglangEngine has loaded into SGLang."""

    def __init__(self, max_loras: int) -> None:
        self.book = LoadedAdapters("SGLang", max_loras)

    @classmethod
    def enabled(cls, engine_args: dict[str, Any], *, lora: bool, max_loras: int | None) -> "SglangAdapters | None":
        """The adapters' book where LoRA is asked for (``lora``, ``max_loras``, or ``enable_lora`` in the extra
        engine args), else None."""
        if not (lora or max_loras is not None or engine_args.get("enable_lora")):
            return None
        return cls(max_loras or int(engine_args.get("max_loaded_loras") or DEFAULT_MAX_LORAS))

    async def load(self, engine: Any, name: str, path: Path) -> None:
        """Load ``name`` from ``path`` into SGLang (``engine``: the started ``sglang.Engine``). Raises EngineError."""
        plan = self.book.plan(name, path)
        if plan == "loaded":
            return
        if engine is None:
            raise EngineError(f"cannot load adapter {name!r}: the SGLang engine is not started")
        from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput

        if plan == "reload":
            await self.unload(engine, name)
        result = await engine.tokenizer_manager.load_lora_adapter(
            LoadLoRAAdapterReqInput(lora_name=name, lora_path=str(path)), None
        )
        if not getattr(result, "success", False):
            raise EngineError(f"SGLang could not load adapter {name!r} from {str(path)!r}: {result.error_message}")
        self.book.add(name, path)

    async def unload(self, engine: Any, name: str) -> None:
        """Unload ``name`` from SGLang (its running requests finish first); nothing where it is not loaded.
        Raises EngineError where SGLang fails to."""
        if name not in self.book or engine is None:
            return
        from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

        # Forgotten first: a request that comes now is refused here, not queued behind SGLang's unload.
        self.book.pop(name)
        result = await engine.tokenizer_manager.unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name=name), None)
        if not getattr(result, "success", False):
            raise EngineError(f"SGLang could not unload adapter {name!r}: {result.error_message}")
