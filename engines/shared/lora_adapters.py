"""What every GPU engine's ``LoraEngine`` (runtime/lora.py) keeps of its adapters, apart from the engine's own calls.

``LoadedAdapters`` is the book of which names are loaded from which paths: it decides whether a load is new, a
repeat (nothing to do), a reload from another path, or one past ``max_loras``, and answers a request's
``lora_name`` with the loaded adapter or an EngineError a person can act on. Each engine calls its own project's
load and unload around it (engines/vllm, engines/sglang, engines/trtllm, engines/llamacpp).
"""

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from runtime.errors import EngineError
from runtime.lora import lora_id

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedAdapter:
    """An adapter an engine holds: served as ``name``, from ``path``, reported as ``id`` (``lora_id(name)``)."""

    name: str
    path: Path
    id: int


#: What ``LoadedAdapters.plan`` says a load is: a new adapter, one already loaded from that path, or one
#: loaded from another path (the old one is unloaded first).
LoadPlan = Literal["new", "loaded", "reload"]


class LoadedAdapters:
    """The adapters an engine has loaded, at most ``max_loras`` at once."""

    def __init__(self, engine: str, max_loras: int) -> None:
        if max_loras < 1:
            raise EngineError(f"{engine}: max_loras must be at least 1, not {max_loras}")
        self.engine = engine
        self.max_loras = max_loras
        self._adapters: dict[str, LoadedAdapter] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def names(self) -> list[str]:
        return list(self._adapters)

    def plan(self, name: str, path: Path, *, kind: Literal["folder", "file"] = "folder") -> LoadPlan:
        """What loading ``name`` from ``path`` takes. Raises EngineError when ``path`` is not a ``kind`` (a PEFT
        folder, or a GGUF file for llama.cpp), or when ``max_loras`` adapters are loaded already."""
        loaded = self._adapters.get(name)
        if loaded is not None and loaded.path == path:
            return "loaded"
        if kind == "folder" and not path.is_dir():
            raise EngineError(f"{self.engine} cannot load adapter {name!r}: {str(path)!r} is not a folder")
        if kind == "folder" and not (path / "adapter_config.json").is_file():
            raise EngineError(
                f"{self.engine} cannot load adapter {name!r}: {str(path)!r} has no adapter_config.json "
                "(a PEFT adapter's folder has adapter_config.json and adapter_model.safetensors)"
            )
        if kind == "file" and not path.is_file():
            raise EngineError(f"{self.engine} cannot load adapter {name!r}: {str(path)!r} is not a file")
        if loaded is None and len(self._adapters) >= self.max_loras:
            raise EngineError(
                f"{self.engine} cannot load adapter {name!r}: it holds {self.max_loras} adapters already "
                f"({', '.join(sorted(self._adapters))}), its max_loras; unload one first or raise --max-loras"
            )
        return "new" if loaded is None else "reload"

    def add(self, name: str, path: Path) -> LoadedAdapter:
        """Note ``name`` as loaded from ``path`` (after the engine loaded it)."""
        adapter = LoadedAdapter(name=name, path=path, id=lora_id(name))
        self._adapters[name] = adapter
        log.info("%s loaded adapter %s from %s (lora id %d)", self.engine, name, path, adapter.id)
        return adapter

    def pop(self, name: str) -> LoadedAdapter | None:
        """Forget ``name``; the adapter it was, or None where it was not loaded."""
        adapter = self._adapters.pop(name, None)
        if adapter is not None:
            log.info("%s unloaded adapter %s", self.engine, name)
        return adapter

    def get(self, name: str) -> LoadedAdapter | None:
        return self._adapters.get(name)

    def require(self, name: str | None) -> LoadedAdapter | None:
        """The adapter a request names (None: the base model). Raises EngineError for one not loaded here."""
        if name is None:
            return None
        adapter = self._adapters.get(name)
        if adapter is None:
            raise EngineError(
                f"adapter {name!r} is not loaded on this {self.engine} worker "
                f"(loaded: {', '.join(sorted(self._adapters)) or 'none'})"
            )
        return adapter
