"""The paged KV cache of one simulated dp rank as vLLM v0 kept it (``scheduler`` "v0"; kv_cache_v1.py: v1).

No memory is simulated, only the bookkeeping a vLLM-like block manager does:

* A sequence's KV lives in blocks of ``block_size`` tokens. Once a block is full (its tokens
  computed) and prefix caching is on, it is named by its sequence hash (runtime/kv/blocks.py) and
  becomes shareable: another sequence whose prompt starts with the same tokens takes a reference to
  it instead of computing it again. The last, partial block of a sequence is private to it. A block
  computed again under a name already cached is merged into the cached one (v0's promotion to an
  immutable block), its own copy freed.
* A full block nobody references any more stays cached, in an LRU of idle blocks, until a new
  block is needed and no never-used one is left: then the least recently used idle block is evicted.
  A sequence frees its blocks last first, so a freed sequence's tail is evicted before its prefix.
* ``watermark`` keeps a share of the blocks out of reach of new sequences, for the running ones to
  grow into (as vLLM's block manager does).

Every change of the named set is recorded as KV events (``BlockStored`` with the parent hash,
``BlockRemoved``, ``AllCleared``) when ``record_events`` is on; the engine hands them to its sink.
Each operation costs in proportion to the blocks it touches: nothing scans the whole cache.
"""

from collections import OrderedDict
from collections.abc import Sequence

from engines.mocker.kv_cache_base import KvCacheBase, SequenceBlocks, chains
from runtime.kv.events import AllCleared, BlockRemoved, BlockStored


class _Block:
    """A named (full) block: how many sequences use it, and the block before it."""

    __slots__ = ("parent", "refs")

    def __init__(self, parent: int | None) -> None:
        self.parent = parent
        self.refs = 1


class KvCacheV0(KvCacheBase):
    """Blocks of one dp rank, v0 style. Not thread-safe: one step loop owns it."""

    def __init__(
        self, num_blocks: int, block_size: int, *, prefix_caching: bool = True, watermark: float = 0.0
    ) -> None:
        """Raises ValueError for a size below 1 or a watermark outside [0, 1)."""
        super().__init__(num_blocks, block_size, prefix_caching=prefix_caching)
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"the watermark must be in [0, 1), not {watermark}")
        #: Blocks new sequences may not take (vLLM: int(watermark * num_gpu_blocks)).
        self.watermark_blocks = int(watermark * num_blocks)
        self._named: dict[int, _Block] = {}
        # Named blocks with no reference, least recently used first: what eviction takes.
        self._idle: OrderedDict[int, None] = OrderedDict()

    # -- what the scheduler asks -------------------------------------------------------------------

    @property
    def cached_blocks(self) -> int:
        """Named blocks, in use or idle."""
        return len(self._named)

    def new_table(self) -> SequenceBlocks:
        return SequenceBlocks()

    def prefix_hit(self, hashes: Sequence[int], max_blocks: int) -> tuple[int, int]:
        """(leading blocks of ``hashes`` cached, how many of those are idle), looking at ``max_blocks`` at most."""
        if not self.prefix_caching:
            return 0, 0
        named = self._named
        hit = idle = 0
        for block_hash in hashes[:max_blocks]:
            block = named.get(block_hash)
            if block is None:
                break
            hit += 1
            if block.refs == 0:
                idle += 1
        return hit, idle

    def can_admit(self, more_blocks: int) -> bool:
        """Whether a new sequence may bring ``more_blocks`` into use (the watermark stays free)."""
        return self.active_blocks + more_blocks <= self.admission_limit

    # -- what a sequence does ----------------------------------------------------------------------

    def acquire_prefix(self, table: SequenceBlocks, hashes: Sequence[int], count: int) -> None:
        """Give ``table`` (still empty) references to the first ``count`` blocks of ``hashes`` (all cached)."""
        named, idle = self._named, self._idle
        for block_hash in hashes[:count]:
            block = named[block_hash]
            if block.refs == 0:
                del idle[block_hash]
                self.active_blocks += 1
            block.refs += 1
            table.cached.append(block_hash)
        table.count += count

    def allocate(self, table: SequenceBlocks, num_tokens: int) -> bool:
        """Give ``table`` enough blocks for ``num_tokens`` tokens, evicting idle blocks as needed.

        Returns False, changing nothing, when even evicting every idle block would not make room.
        """
        needed = -(-num_tokens // self.block_size) - table.count
        if needed <= 0:
            return True
        if needed > self.num_blocks - self.active_blocks:
            return False
        never_used = self.num_blocks - self.active_blocks - len(self._idle)
        if needed > never_used:
            self._evict(needed - never_used)
        self.active_blocks += needed
        table.private += needed
        table.count += needed
        return True

    def commit(self, table: SequenceBlocks, hashes: Sequence[int], full_blocks: int) -> None:
        """Name the blocks of ``table`` up to ``full_blocks`` (now computed) by ``hashes``, sharing known ones.

        A block another sequence already computed and named is shared instead, and this one's
        private copy goes back to the free blocks. Nothing happens with prefix caching off.
        """
        if not self.prefix_caching:
            return
        named, idle = self._named, self._idle
        cached = table.cached
        for index in range(len(cached), full_blocks):
            block_hash = hashes[index]
            parent = cached[-1] if cached else None
            block = named.get(block_hash)
            if block is None:
                named[block_hash] = _Block(parent)
                if self.record_events:
                    self._record_stored(block_hash, parent)
            else:
                if block.refs == 0:
                    del idle[block_hash]  # back in use, in place of the private copy: in-use count unchanged
                else:
                    self.active_blocks -= 1  # the private copy is given back
                block.refs += 1
            table.private -= 1
            cached.append(block_hash)

    def free(self, table: SequenceBlocks) -> None:
        """Release every block of ``table``; named blocks stay cached (idle), tail first in eviction order."""
        named, idle = self._named, self._idle
        for block_hash in reversed(table.cached):
            block = named[block_hash]
            block.refs -= 1
            if block.refs == 0:
                idle[block_hash] = None
                self.active_blocks -= 1
        self.active_blocks -= table.private
        table.cached.clear()
        table.private = 0
        table.count = 0

    def reset_prefix_cache(self) -> int:
        """Drop every idle cached block (vLLM's reset_prefix_cache); returns how many were dropped."""
        dropped = list(self._idle)
        if not dropped:
            return 0
        for block_hash in dropped:
            del self._named[block_hash]
        self._idle.clear()
        if self.record_events:
            self._events.append(AllCleared() if not self._named else BlockRemoved(dropped))
        return len(dropped)

    # -- what routers learn ------------------------------------------------------------------------

    def cache_state(self) -> list[BlockStored]:
        """Every named block as stored events: chains in the order they were stored, parents first."""
        return chains([(block_hash, block.parent) for block_hash, block in self._named.items()])

    def _evict(self, count: int) -> None:
        idle, named = self._idle, self._named
        evicted = [idle.popitem(last=False)[0] for _ in range(count)]
        for block_hash in evicted:
            del named[block_hash]
        if self.record_events:
            self._record_removed(evicted)
