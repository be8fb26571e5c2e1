"""What the v0 and v1 KV caches of the mocker share: sizes, usage, block tables and the KV event log.

kv_cache_v0.py keeps v0's bookkeeping, kv_cache_v1.py v1's block pool; the scheduler talks to either
through this interface. Both record the same events, the way a router indexes them: a chain of
``BlockStored`` blocks (a sequence's blocks are named one after the other), ``BlockRemoved`` for
evictions, ``AllCleared`` when a reset leaves nothing.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence

from runtime.kv.events import BlockRemoved, BlockStored, KvEvent, Medium


class SequenceBlocks:
    """The blocks one sequence holds, in order: named full blocks (by hash), then private ones."""

    __slots__ = ("cached", "count", "private")

    def __init__(self) -> None:
        self.cached: list[int] = []
        self.private = 0
        #: len(cached) + private, kept as a plain attribute: the scheduler reads it every step.
        self.count = 0


class KvCacheBase(ABC):
    """Blocks of one dp rank. Not thread-safe: one step loop owns it."""

    #: Blocks new sequences may not take (v0's watermark; none under v1).
    watermark_blocks = 0
    #: Whether a reset that leaves the device empty is announced as ``AllCleared``. False beside a host tier:
    #: a router reads ``AllCleared`` as every tier of the rank gone, and the host's blocks are still there.
    announce_all_cleared = True

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool) -> None:
        """Raises ValueError for a size below 1."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV cache needs at least one block of one token, not {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        #: Blocks held by sequences (a block shared by several counts once).
        self.active_blocks = 0
        self.record_events = False
        self._events: list[KvEvent] = []

    # -- what the scheduler asks -------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of the blocks in use by sequences (idle cached blocks count as free)."""
        return self.active_blocks / self.num_blocks

    @property
    def admission_limit(self) -> int:
        """The most blocks in use once a new sequence is admitted (all of them less the watermark)."""
        return self.num_blocks - self.watermark_blocks

    @property
    @abstractmethod
    def cached_blocks(self) -> int:
        """Hashes cached, in use or idle."""

    @abstractmethod
    def new_table(self) -> SequenceBlocks:
        """An empty block table of the kind this cache hands to ``acquire_prefix`` and the rest."""

    @abstractmethod
    def prefix_hit(self, hashes: Sequence[int], max_blocks: int) -> tuple[int, int]:
        """(leading blocks of ``hashes`` cached, how many of those are idle), looking at ``max_blocks`` at most."""

    @abstractmethod
    def can_admit(self, more_blocks: int) -> bool:
        """Whether a new sequence may bring ``more_blocks`` into use."""

    # -- what a sequence does ----------------------------------------------------------------------

    @abstractmethod
    def acquire_prefix(self, table: SequenceBlocks, hashes: Sequence[int], count: int) -> None:
        """Give ``table`` (still empty) the first ``count`` blocks of ``hashes`` (all cached)."""

    @abstractmethod
    def allocate(self, table: SequenceBlocks, num_tokens: int) -> bool:
        """Give ``table`` blocks up to ``num_tokens`` tokens; False, changing nothing, when they do not fit."""

    @abstractmethod
    def commit(self, table: SequenceBlocks, hashes: Sequence[int], full_blocks: int) -> None:
        """Name ``table``'s blocks up to ``full_blocks`` (computed) by ``hashes``."""

    @abstractmethod
    def free(self, table: SequenceBlocks) -> None:
        """Release every block of ``table``; named ones stay cached until evicted."""

    @abstractmethod
    def reset_prefix_cache(self) -> int:
        """Drop every idle cached block (vLLM's reset_prefix_cache); returns how many hashes went."""

    # -- what routers learn ------------------------------------------------------------------------

    @abstractmethod
    def cache_state(self) -> list[BlockStored]:
        """Every cached hash as stored events: chains in the order they were stored, parents first."""

    def take_events(self) -> list[KvEvent]:
        """The events recorded since the last call, in order."""
        events = self._events
        if events:
            self._events = []
        return events

    def _record_stored(self, block_hash: int, parent: int | None) -> None:
        events = self._events
        # A sequence's blocks are named one after the other: extend its chain in the last event.
        if events and isinstance(last := events[-1], BlockStored) and last.block_hashes[-1] == parent:
            last.block_hashes.append(block_hash)
        else:
            events.append(BlockStored([block_hash], parent))

    def _record_removed(self, hashes: list[int]) -> None:
        events = self._events
        if events and isinstance(last := events[-1], BlockRemoved):
            last.block_hashes.extend(hashes)
        else:
            events.append(BlockRemoved(hashes))


def chains(named: Sequence[tuple[int, int | None]], medium: Medium | None = None) -> list[BlockStored]:
    """(hash, parent) pairs in the order they were stored, as stored events on tier ``medium`` (None: the
    device): a block whose parent ends the current chain extends it."""
    state: list[BlockStored] = []
    current: BlockStored | None = None
    for block_hash, parent in named:
        if current is not None and parent == current.block_hashes[-1]:
            current.block_hashes.append(block_hash)
        else:
            current = BlockStored([block_hash], parent, medium=medium)
            state.append(current)
    return state
