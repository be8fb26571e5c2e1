"""The mocker's v1 KV cache (vLLM v1's block pool): copies, one free queue, events per hash."""

from engines.mocker.kv_cache_v0 import KvCacheV0
from engines.mocker.kv_cache_v1 import BlockTable, KvCacheV1
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import AllCleared, BlockRemoved, BlockStored

BLOCK = 4


def filled(cache: KvCacheV1, tokens: list[int]) -> tuple[BlockTable, list[int]]:
    """A table that computed ``tokens`` (its full blocks cached)."""
    table = cache.new_table()
    hashes = sequence_block_hashes(tokens, BLOCK)
    assert cache.allocate(table, len(tokens))
    cache.commit(table, hashes, len(tokens) // BLOCK)
    return table, hashes


def test_a_block_computed_twice_is_two_copies_announced_once_and_removed_with_the_last() -> None:
    cache = KvCacheV1(4, BLOCK)
    cache.record_events = True
    first, hashes = filled(cache, list(range(4)))
    second, _ = filled(cache, list(range(4)))
    assert cache.active_blocks == 2 and cache.copies(hashes[0]) == 2 and cache.cached_blocks == 1
    assert cache.take_events() == [BlockStored([hashes[0]], None)]
    cache.free(first)
    cache.free(second)
    other = cache.new_table()
    assert cache.allocate(other, 3 * BLOCK)  # two never used, then the head of the free queue: one copy
    assert cache.copies(hashes[0]) == 1 and cache.take_events() == []
    assert cache.allocate(other, 4 * BLOCK)  # the other copy: the hash is gone
    assert cache.copies(hashes[0]) == 0 and cache.take_events() == [BlockRemoved([hashes[0]])]


def test_the_first_copy_cached_is_the_one_a_hit_takes() -> None:
    cache = KvCacheV1(4, BLOCK)
    first, hashes = filled(cache, list(range(4)))
    kept = first.held[0]
    filled(cache, list(range(4)))  # a second copy, still in use
    cache.free(first)
    hit = cache.new_table()
    assert cache.prefix_hit(hashes, 1) == (1, 1)  # the first copy, now free
    cache.acquire_prefix(hit, hashes, 1)
    assert hit.held[0] is kept and cache.active_blocks == 2


def test_a_freed_unnamed_block_is_given_before_a_cached_block_is_evicted_whatever_the_order_freed() -> None:
    # As Dynamo 1.6.1's mocker keeps its pool (a released private block goes back to free capacity, a
    # cached one to an LRU evicted only when no free capacity is left); v0 does the same.
    for cache_type in (KvCacheV1, KvCacheV0):
        cache = cache_type(3, BLOCK)
        cached = cache.new_table()
        hashes = sequence_block_hashes(list(range(4)), BLOCK)
        assert cache.allocate(cached, BLOCK)
        cache.commit(cached, hashes, 1)
        plain = cache.new_table()
        assert cache.allocate(plain, 2)
        cache.free(cached)  # the cached block is freed first
        cache.free(plain)
        newer = cache.new_table()
        assert cache.allocate(newer, 2 * BLOCK)  # the one never used and the plain one freed
        assert cache.prefix_hit(hashes, 1) == (1, 1), cache_type
        assert cache.allocate(newer, 3 * BLOCK)  # only now is the cached block evicted
        assert cache.prefix_hit(hashes, 1) == (0, 0), cache_type


def test_a_sequence_frees_its_tail_first_so_its_prefix_is_evicted_last() -> None:
    cache = KvCacheV1(3, BLOCK)
    table, hashes = filled(cache, list(range(12)))
    cache.free(table)
    cache.record_events = True
    newer = cache.new_table()
    assert cache.allocate(newer, 2 * BLOCK)
    assert cache.take_events() == [BlockRemoved([hashes[2], hashes[1]])]
    assert cache.prefix_hit(hashes, 3) == (1, 1)


def test_allocation_beyond_the_free_blocks_changes_nothing() -> None:
    cache = KvCacheV1(2, BLOCK)
    table, _ = filled(cache, list(range(4)))
    other = cache.new_table()
    assert not cache.allocate(other, 2 * BLOCK)
    assert (other.count, cache.active_blocks, cache.free_blocks) == (0, 1, 1)
    assert cache.can_admit(1) and not cache.can_admit(2)
    cache.free(table)
    assert cache.allocate(other, 2 * BLOCK) and cache.active_blocks == 2


def test_reset_drops_the_free_cached_blocks_and_keeps_those_in_use() -> None:
    cache = KvCacheV1(4, BLOCK)
    cache.record_events = True
    used, used_hashes = filled(cache, list(range(4)))
    idle, idle_hashes = filled(cache, list(range(100, 104)))
    cache.free(idle)
    cache.take_events()
    assert cache.reset_prefix_cache() == 1
    assert cache.take_events() == [BlockRemoved([idle_hashes[0]])]
    assert cache.prefix_hit(used_hashes, 1) == (1, 0) and cache.prefix_hit(idle_hashes, 1) == (0, 0)
    cache.free(used)
    assert cache.reset_prefix_cache() == 1 and cache.take_events() == [AllCleared()]
    assert cache.cached_blocks == 0


def test_cache_state_lists_each_cached_hash_once_in_chains() -> None:
    cache = KvCacheV1(8, BLOCK)
    _, hashes = filled(cache, list(range(12)))
    filled(cache, list(range(12)))  # copies of all three
    assert cache.cache_state() == [BlockStored(hashes, None)]


def test_prefix_caching_off_caches_nothing() -> None:
    cache = KvCacheV1(4, BLOCK, prefix_caching=False)
    table, hashes = filled(cache, list(range(8)))
    assert cache.cached_blocks == 0 and cache.prefix_hit(hashes, 2) == (0, 0) and table.count == 2
    cache.free(table)
    assert cache.active_blocks == 0
