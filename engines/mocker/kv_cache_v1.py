"""The paged KV cache of one simulated dp rank as vLLM v1's block pool keeps it (``scheduler`` "v1").

vLLM v1 (``vllm/v1/core/block_pool.py``, ``kv_cache_manager.py``) differs from the v0 bookkeeping
of kv_cache_v0.py in three ways this module copies:

* Blocks are physical: a sequence owns the blocks it was given, and its block table only grows. A
  full block is cached (named by its sequence hash) when the step that computes it is scheduled,
  even when another block of the same hash is already cached: two sequences that compute the same
  block (the same prompt prefilled side by side, or the last block of a fully cached prompt, which
  is always recomputed) each hold a copy. The hash maps to its copies in the order they were
  cached, and a prefix hit takes the first (``cached_block_hash_to_block``); a copy leaves the map
  only when its block is reused for something else.
* Free blocks with no name (never used, or freed unfilled) are given first; then cached blocks no
  one holds, evicted in the order they were freed (a sequence frees its blocks last first). So a
  cached block is evicted only when no anonymous block is left, as Dynamo 1.6.1's mocker keeps its
  pool (aisimulate's ``VllmBlockPool``: a released private block goes back to free capacity, a cached
  one to the tail of an inactive LRU). vLLM itself keeps both in one queue in the order freed.
* No watermark: any free block may go to any sequence.

The KV events say which hashes the rank can hit, as routers index them (a set of hashes per
worker): ``BlockStored`` when a hash gets its first copy, ``BlockRemoved`` when its last copy is
evicted. (vLLM announces every copy and every eviction; for a router that keeps a set, the
eviction of one of two copies would erase a block the worker still has.)
"""

from collections import OrderedDict
from collections.abc import Sequence

from engines.mocker.kv_cache_base import KvCacheBase, SequenceBlocks, chains
from runtime.kv.events import AllCleared, BlockRemoved, BlockStored


class KvBlock:
    """One physical block: its name once full and cached (else None), the name before it, its users."""

    __slots__ = ("block_hash", "parent", "refs")

    def __init__(self) -> None:
        self.block_hash: int | None = None
        self.parent: int | None = None
        self.refs = 1


class BlockTable(SequenceBlocks):
    """A sequence's blocks under v1: ``held`` in order, named ones (``cached``: their hashes) first."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        super().__init__()
        self.held: list[KvBlock] = []


class KvCacheV1(KvCacheBase):
    """Blocks of one dp rank, v1 style (no watermark). Not thread-safe: one step loop owns it."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True) -> None:
        """Raises ValueError for a size below 1."""
        super().__init__(num_blocks, block_size, prefix_caching=prefix_caching)
        # Free blocks: first those with no name (a count: they have no state), then the cached ones in
        # the order they were freed; a cached one leaves from the front, or when a hit revives it.
        self._unnamed_free = num_blocks
        self._freed: OrderedDict[KvBlock, None] = OrderedDict()
        # Hash -> its cached copies, in the order they were cached; a hit takes the first.
        self._copies: dict[int, list[KvBlock]] = {}

    # -- what the scheduler asks -------------------------------------------------------------------

    @property
    def cached_blocks(self) -> int:
        """Hashes cached, in use or free (a hash with two copies counts once)."""
        return len(self._copies)

    @property
    def free_blocks(self) -> int:
        """Blocks a sequence may be given now, evicting cached ones as needed."""
        return self.num_blocks - self.active_blocks

    def new_table(self) -> BlockTable:
        return BlockTable()

    def copies(self, block_hash: int) -> int:
        """How many cached blocks hold ``block_hash`` (0: none)."""
        return len(self._copies.get(block_hash, ()))

    def prefix_hit(self, hashes: Sequence[int], max_blocks: int) -> tuple[int, int]:
        """(leading blocks of ``hashes`` cached, how many of those are free), looking at ``max_blocks`` at most."""
        if not self.prefix_caching:
            return 0, 0
        copies = self._copies
        hit = idle = 0
        for block_hash in hashes[:max_blocks]:
            found = copies.get(block_hash)
            if found is None:
                break
            hit += 1
            if found[0].refs == 0:
                idle += 1
        return hit, idle

    def can_admit(self, more_blocks: int) -> bool:
        """Whether a sequence may bring ``more_blocks`` into use (hit blocks revived from the free
        queue included, as vLLM's ``get_num_blocks_to_allocate`` counts them)."""
        return more_blocks <= self.num_blocks - self.active_blocks

    # -- what a sequence does ----------------------------------------------------------------------

    def acquire_prefix(self, table: SequenceBlocks, hashes: Sequence[int], count: int) -> None:
        """Give ``table`` (still empty) the first cached copy of each of the first ``count`` ``hashes``."""
        held = _held(table)
        copies, freed = self._copies, self._freed
        for block_hash in hashes[:count]:
            block = copies[block_hash][0]
            if block.refs == 0:
                del freed[block]
                self.active_blocks += 1
            block.refs += 1
            held.append(block)
            table.cached.append(block_hash)
        table.count += count

    def allocate(self, table: SequenceBlocks, num_tokens: int) -> bool:
        """Give ``table`` new blocks up to ``num_tokens`` tokens: unnamed free blocks first, then cached ones
        no one holds, evicted from the head of their queue.

        Returns False, changing nothing, when too few blocks are free.
        """
        needed = -(-num_tokens // self.block_size) - table.count
        if needed <= 0:
            return True
        if needed > self.num_blocks - self.active_blocks:
            return False
        held = _held(table)
        fresh = min(needed, self._unnamed_free)
        self._unnamed_free -= fresh
        for _ in range(fresh):
            held.append(KvBlock())
        reused = needed - fresh
        if reused:
            freed = self._freed
            evicted: list[int] = []
            for _ in range(reused):
                block = freed.popitem(last=False)[0]
                if self._uncache(block):
                    evicted.append(block.block_hash)  # type: ignore[arg-type]  # named: it was cached
                block.block_hash = block.parent = None
                block.refs = 1
                held.append(block)
            if evicted and self.record_events:
                self._record_removed(evicted)
        self.active_blocks += needed
        table.private += needed
        table.count += needed
        return True

    def commit(self, table: SequenceBlocks, hashes: Sequence[int], full_blocks: int) -> None:
        """Cache ``table``'s blocks up to ``full_blocks`` (computed in the step being scheduled) by ``hashes``.

        Each block is cached as itself, beside any copy already cached under its hash (v1 does not
        merge them). Nothing happens with prefix caching off.
        """
        if not self.prefix_caching:
            return
        held = _held(table)
        copies = self._copies
        cached = table.cached
        for index in range(len(cached), full_blocks):
            block_hash = hashes[index]
            block = held[index]
            block.block_hash = block_hash
            block.parent = cached[-1] if cached else None
            found = copies.get(block_hash)
            if found is None:
                copies[block_hash] = [block]
                if self.record_events:
                    self._record_stored(block_hash, block.parent)
            else:
                found.append(block)
            table.private -= 1
            cached.append(block_hash)

    def free(self, table: SequenceBlocks) -> None:
        """Release ``table``'s blocks: unnamed ones to the free blocks given first, cached ones to the tail
        of the cached free queue, last first (evicted first), cached until reused."""
        held = _held(table)
        freed = self._freed
        for block in reversed(held):
            block.refs -= 1
            if block.refs == 0:
                if block.block_hash is None:
                    self._unnamed_free += 1
                else:
                    freed[block] = None
                self.active_blocks -= 1
        held.clear()
        table.cached.clear()
        table.private = 0
        table.count = 0

    def reset_prefix_cache(self) -> int:
        """Uncache every cached block in the free queue; returns how many hashes are no longer cached."""
        dropped: list[int] = []
        for block in self._freed:  # every one is cached (unnamed free blocks are only counted)
            if self._uncache(block):
                dropped.append(block.block_hash)  # type: ignore[arg-type]  # named: it was cached
        self._unnamed_free += len(self._freed)
        self._freed.clear()
        if dropped and self.record_events:
            self._events.append(
                AllCleared() if not self._copies and self.announce_all_cleared else BlockRemoved(dropped)
            )
        return len(dropped)

    # -- what routers learn ------------------------------------------------------------------------

    def cache_state(self) -> list[BlockStored]:
        """Every cached hash as stored events: chains in the order they were first cached, parents first."""
        return chains([(block_hash, found[0].parent) for block_hash, found in self._copies.items()])

    def _uncache(self, block: KvBlock) -> bool:
        """Take ``block`` out of its hash's copies; True when it was the last copy (the hash is gone)."""
        block_hash = block.block_hash
        assert block_hash is not None
        found = self._copies[block_hash]
        found.remove(block)  # identity: blocks compare as themselves
        if found:
            return False
        del self._copies[block_hash]
        return True


def _held(table: SequenceBlocks) -> list[KvBlock]:
    if not isinstance(table, BlockTable):
        raise TypeError("a v1 KV cache takes the block tables it makes (KvCacheV1.new_table)")
    return table.held
