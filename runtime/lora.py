"""LoRA adapters: what a worker loads beside its base model, and what the fleet's parts say of them.

An adapter is served under its own model name (``/v1/models`` lists it, with the base model as its
``parent``). The pieces, and who owns each:

* **What a worker should have loaded** is an ``AdapterSet``: the adapters given to ``flotilla run`` with
  ``--lora NAME=PATH`` at its start, and the JSON file named by ``--lora-file`` (the node's agent writes it,
  atomically, from the control plane's signed ``SetAdapters`` task; a worker started by hand may use it too).
  The worker watches that file and loads and unloads adapters at run time, without a restart.
* **An engine that takes adapters** implements ``LoraEngine``: ``load_lora`` / ``unload_lora``, and a
  request naming ``lora_name`` (``PreprocessedRequest`` / ``TextRequest``) is run with that adapter.
* **What a worker serves** is registered in etcd as one ``ModelEntry`` per loaded adapter, beside its base
  model's, with ``ModelEntry.lora`` set; a gateway pools them by name, as every model, so each adapter has
  its own router, and sends its requests with ``lora_name`` set.
* **KV routing with the adapter in the block hashes**: a block computed with an adapter can serve only
  requests with that adapter. Engines report it in ``BlockStored.lora_id``, which is ``lora_id(name)``
  on every worker (a stable number from the adapter's name, so that all workers and routers agree without
  asking each other); an adapter's pool indexes only the events of its ``lora_id``, the base model's pool
  only those without one.
"""

import hashlib
from pathlib import Path
from typing import Protocol, runtime_checkable

import msgspec
import xxhash

from runtime.kv.blocks import HASH_SEED

#: Names an adapter may have: a served model name (letters, digits, ``._-:/``), at most this long.
MAX_NAME_LENGTH = 128


def lora_id(name: str) -> int:
    """The adapter ``name``'s number, as engines report it in KV events and take it in their LoRA requests
    (vLLM's ``lora_int_id``): the first 31 bits of its name's SHA-256, never 0 (vLLM reads 0 as "no adapter").
    """
    value = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") & 0x7FFFFFFF
    return value or 1


class LoraAdapter(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One adapter a worker should have loaded: served as ``name``, its files in the folder ``path`` on the
    worker's machine (a PEFT folder: ``adapter_config.json`` and ``adapter_model.safetensors``; a GGUF file
    for llama.cpp)."""

    name: str
    path: str


class AdapterSet(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The content of a worker's ``--lora-file``: every adapter it should have loaded now. ``generation``
    counts the control plane's changes of the set; a worker reports the one it has applied."""

    adapters: list[LoraAdapter] = []
    generation: int = 0


class LoraInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker registers of an adapter it serves (``ModelEntry.lora``)."""

    name: str
    #: ``lora_id(name)``: the number in its KV events.
    id: int
    #: The served name of the base model it adapts.
    base: str


@runtime_checkable
class LoraEngine(Protocol):
    """An engine that loads LoRA adapters at run time."""

    #: How many adapters it holds at once (vLLM's ``max_loras``); a load past it is refused.
    max_loras: int

    async def load_lora(self, name: str, path: Path) -> None:
        """Load the adapter in ``path`` as ``name`` (its KV events say ``lora_id(name)``); loading a name
        already loaded from the same path does nothing. Raises EngineError with a message a person can act on
        (no such folder, not an adapter of this base model, too many adapters)."""
        ...

    async def unload_lora(self, name: str) -> None:
        """Unload adapter ``name``; requests of it still running finish first or end with an error. Unloading a
        name not loaded does nothing."""
        ...


def lora_root_hash(lora: int | None) -> int | None:
    """The parent hash an adapter's block chains start from: its number hashed (runtime/kv/blocks.py's hash), so
    that a block computed with adapter ``lora`` (a ``lora_id``) has another sequence hash than the base model's
    block of the same tokens, and than any other adapter's, as vLLM mixes the adapter into its block hashes. Every
    engine names its adapter blocks so (``sequence_block_hashes(tokens, size, parent=lora_root_hash(id))``) and
    every router names an adapter's requests so; None (the base model) for None."""
    if lora is None:
        return None
    return xxhash.xxh3_64_intdigest(b"flotilla-lora:" + lora.to_bytes(8, "little"), seed=HASH_SEED)
