"""Naming a real engine's cached blocks as Flotilla's router names them, from the engine's KV events.

SGLang and TensorRT-LLM name their blocks with hashes of their own; Flotilla's router names a request's
blocks with runtime/kv/blocks.py's chained hash over the tokens. So the engine's stored events, which
carry the blocks' token ids, are re-hashed here into Flotilla's names, and the engine-hash → Flotilla-hash
map is kept for the removals, which name the engine's hashes only (as Dynamo's publisher does). The same
map is the worker's answer when a router asks for the whole cache state (the libraries have no such call).

Engines that offload keep copies of a block on several tiers (the GPU, host memory, a disk) and say which in
each event. A block's Flotilla name depends only on its tokens and its parent chain, so one engine hash has
one name on every tier: the name is kept once, with the set of tiers that hold the block, so that a removal
from the host tier drops the host copy only, a block stored on the host may chain from a parent that only the
GPU holds (and the other way round), and the name is forgotten when no tier holds the block any more.

A block computed with a LoRA adapter (``lora_id``) is named in a chain that starts from the adapter's root hash
(runtime/lora.py ``lora_root_hash``), so that it is never taken for the base model's block of the same tokens.

Blocks whose parent this map never heard of (events lost before the worker subscribed) cannot be named
(their Flotilla hash chains the parent's): they are skipped, and so are their descendants.
"""

from collections.abc import Sequence

from runtime.kv.events import LOWER_TIERS, AllCleared, BlockRemoved, BlockStored, KvEvent, Medium
from runtime.kv.image_blocks import BlockKeys, keyed_sequence_hashes
from runtime.lora import lora_root_hash

#: A tier as kept here: None for the device (an event's "gpu" is the same tier).
Tier = Medium | None
#: The order ``state()`` lists tiers in: the device, then the lower tiers best first.
_TIER_ORDER: tuple[Tier, ...] = (None, *LOWER_TIERS)


def _tier(medium: Medium | None) -> Tier:
    return None if medium == "gpu" else medium


class EngineBlockNames:
    """One dp rank's map from the engine's block hashes to Flotilla's, on every tier the engine keeps."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, not {block_size}")
        self.block_size = block_size
        # engine hash -> (Flotilla hash, Flotilla parent hash), for blocks that some tier holds.
        self._names: dict[int, tuple[int, int | None]] = {}
        # tier -> the engine hashes it holds (a dict as an ordered set: insertion order is prefix order).
        self._tiers: dict[Tier, dict[int, None]] = {tier: {} for tier in _TIER_ORDER}

    def __len__(self) -> int:
        """The blocks the device holds."""
        return len(self._tiers[None])

    def held(self, medium: Medium | None = None) -> int:
        """How many blocks ``medium``'s tier holds (None or "gpu": the device)."""
        return len(self._tiers[_tier(medium)])

    def stored(
        self,
        engine_hashes: Sequence[int],
        engine_parent: int | None,
        token_ids: Sequence[int],
        *,
        lora_id: int | None = None,
        medium: Medium | None = None,
        extra_keys: Sequence[BlockKeys | None] | None = None,
    ) -> BlockStored | None:
        """Flotilla's event for blocks the engine stored on ``medium``'s tier (``token_ids``: theirs, block after
        block; ``extra_keys``: each block's, as vLLM sends them, images' among them: runtime/kv/image_blocks.py);
        None when they cannot be named: a parent no tier holds, or tokens that are not ``block_size`` per block."""
        if not engine_hashes or len(token_ids) != len(engine_hashes) * self.block_size:
            return None
        if engine_parent is None:
            # An adapter's chain starts from its root hash, as its routers name its requests (runtime/lora.py).
            parent = lora_root_hash(lora_id)
        elif (known := self._names.get(engine_parent)) is not None:
            parent = known[0]
        else:
            return None
        tier = _tier(medium)
        names = keyed_sequence_hashes(token_ids, self.block_size, extra_keys, parent)
        held = self._tiers[tier]
        previous = parent
        for engine_hash, name in zip(engine_hashes, names, strict=True):
            self._names[engine_hash] = (name, previous)
            held[engine_hash] = None
            previous = name
        return BlockStored(block_hashes=names, parent_hash=parent, lora_id=lora_id, medium=tier)

    def removed(self, engine_hashes: Sequence[int], *, medium: Medium | None = None) -> BlockRemoved | None:
        """Flotilla's event for blocks the engine evicted from ``medium``'s tier; None when that tier held none
        of them. Copies on other tiers stay."""
        tier = _tier(medium)
        held = self._tiers[tier]
        names = []
        for engine_hash in engine_hashes:
            if engine_hash not in held:
                continue
            del held[engine_hash]
            names.append(self._names[engine_hash][0])
            if not any(engine_hash in blocks for blocks in self._tiers.values()):
                del self._names[engine_hash]
        return BlockRemoved(block_hashes=names, medium=tier) if names else None

    def removed_everywhere(self, engine_hashes: Sequence[int]) -> list[BlockRemoved]:
        """Flotilla's events for blocks the engine evicted without naming a tier (TensorRT-LLM keeps a block on
        one tier at a time, and its removals name none): one removal per tier that held some of them."""
        removals = [self.removed(engine_hashes, medium=tier) for tier in _TIER_ORDER]
        return [removal for removal in removals if removal is not None]

    def moved(self, engine_hash: int, source: Medium | None, target: Medium | None) -> list[KvEvent]:
        """Flotilla's events for a block the engine moved from tier ``source`` to tier ``target`` (TensorRT-LLM
        offloads a block off the GPU this way, and brings it back): its removal from the one and its store on
        the other; none when the block was never named, or when the tiers are the same."""
        source, target = _tier(source), _tier(target)
        known = self._names.get(engine_hash)
        if known is None or source == target:
            return []
        events: list[KvEvent] = []
        if engine_hash in self._tiers[source]:
            del self._tiers[source][engine_hash]
            events.append(BlockRemoved(block_hashes=[known[0]], medium=source))
        self._tiers[target][engine_hash] = None
        events.append(BlockStored(block_hashes=[known[0]], parent_hash=known[1], medium=target))
        return events

    def cleared(self) -> AllCleared:
        """The event for a reset: every tier's blocks are forgotten (Flotilla's AllCleared names no tier)."""
        self._names.clear()
        for blocks in self._tiers.values():
            blocks.clear()
        return AllCleared()

    def state(self) -> list[BlockStored]:
        """Every block of every tier, one stored event per block and tier (the device's with no medium),
        each block after its parent's: the device's first, then the lower tiers best first, each in the order
        the engine stored them, and a block whose parent is listed later (a parent stored on another tier
        after its child) moved after it."""
        entries = [(tier, engine_hash) for tier in _TIER_ORDER for engine_hash in self._tiers[tier]]
        depth = self._depths()
        entries.sort(key=lambda entry: depth[self._names[entry[1]][0]])  # stable: keeps the order above per depth
        events = []
        for tier, engine_hash in entries:
            name, parent = self._names[engine_hash]
            events.append(BlockStored(block_hashes=[name], parent_hash=parent, medium=tier))
        return events

    def _depths(self) -> dict[int, int]:
        """Each held block's Flotilla name -> how many held ancestors it chains from."""
        parents = dict(self._names.values())
        depths: dict[int, int] = {}
        for name in parents:
            chain = []
            current: int | None = name
            while current is not None and current in parents and current not in depths:
                chain.append(current)
                current = parents[current]
            base = depths[current] + 1 if current is not None and current in depths else 0
            for offset, link in enumerate(reversed(chain)):
                depths[link] = base + offset
        return depths
