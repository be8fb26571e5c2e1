"""Naming a real engine's cached blocks as Flotilla's router names them, from the engine's KV events.

SGLang and TensorRT-LLM name their blocks with hashes of their own; Flotilla's router names a request's
blocks with runtime/kv/blocks.py's chained hash over the tokens. So the engine's stored events, which
carry the blocks' token ids, are re-hashed here into Flotilla's names, and the engine-hash → Flotilla-hash
map is kept for the removals, which name the engine's hashes only (as Dynamo's publisher does). The same
map is the worker's answer when a router asks for the whole cache state (the libraries have no such call).

Blocks whose parent this map never heard of (events lost before the worker subscribed) cannot be named
(their Flotilla hash chains the parent's): they are skipped, and so are their descendants.
"""

from collections.abc import Sequence

from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import AllCleared, BlockRemoved, BlockStored, Medium


class EngineBlockNames:
    """One dp rank's map from the engine's block hashes to Flotilla's, for blocks on the GPU tier."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, not {block_size}")
        self.block_size = block_size
        # engine hash -> (Flotilla hash, Flotilla parent hash); insertion order is prefix order.
        self._blocks: dict[int, tuple[int, int | None]] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def stored(
        self,
        engine_hashes: Sequence[int],
        engine_parent: int | None,
        token_ids: Sequence[int],
        *,
        lora_id: int | None = None,
        medium: Medium | None = None,
    ) -> BlockStored | None:
        """Flotilla's event for blocks the engine stored (``token_ids``: theirs, block after block); None when
        they cannot be named: an unknown parent, or tokens that are not ``block_size`` per block."""
        if not engine_hashes or len(token_ids) != len(engine_hashes) * self.block_size:
            return None
        if engine_parent is None:
            parent = None
        elif (known := self._blocks.get(engine_parent)) is not None:
            parent = known[0]
        else:
            return None
        names = sequence_block_hashes(token_ids, self.block_size, parent)
        if medium in (None, "gpu"):
            previous = parent
            for engine_hash, name in zip(engine_hashes, names, strict=True):
                self._blocks[engine_hash] = (name, previous)
                previous = name
        return BlockStored(block_hashes=names, parent_hash=parent, lora_id=lora_id, medium=medium)

    def removed(self, engine_hashes: Sequence[int], *, medium: Medium | None = None) -> BlockRemoved | None:
        """Flotilla's event for blocks the engine evicted; None when none of them was named here."""
        if medium not in (None, "gpu"):
            return None  # only the GPU tier is mapped (and routed on)
        names = [known[0] for engine_hash in engine_hashes if (known := self._blocks.pop(engine_hash, None))]
        return BlockRemoved(block_hashes=names) if names else None

    def cleared(self) -> AllCleared:
        self._blocks.clear()
        return AllCleared()

    def state(self) -> list[BlockStored]:
        """Every named block, one stored event each, parents before children."""
        return [BlockStored(block_hashes=[name], parent_hash=parent) for name, parent in self._blocks.values()]
