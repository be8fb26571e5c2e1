"""The mocker's paged KV cache: sharing, LRU eviction, watermark, prefix caching off, KV events."""

from engines.mocker.kv_cache_base import SequenceBlocks
from engines.mocker.kv_cache_v0 import KvCacheV0
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import AllCleared, BlockRemoved, BlockStored

BLOCK = 4


def hashes(first: int, blocks: int) -> list[int]:
    return sequence_block_hashes(list(range(first, first + blocks * BLOCK)), BLOCK)


def prefill(cache: KvCacheV0, tokens: int, names: list[int]) -> SequenceBlocks:
    """A sequence that computed ``tokens`` tokens (its cached prefix reused); ``names``: its first full blocks."""
    table = SequenceBlocks()
    hit, _ = cache.prefix_hit(names, len(names))
    cache.acquire_prefix(table, names, hit)
    assert cache.allocate(table, tokens)
    cache.commit(table, names, min(tokens // BLOCK, len(names)))
    return table


def recording(cache: KvCacheV0) -> KvCacheV0:
    cache.record_events = True
    return cache


def test_a_second_sequence_shares_the_cached_prefix() -> None:
    cache = KvCacheV0(16, BLOCK)
    names = hashes(0, 3)
    first = prefill(cache, 14, names)  # 3 full blocks and a partial one
    assert cache.active_blocks == 4
    assert cache.prefix_hit(names, 3) == (3, 0)
    second = prefill(cache, 14, names)
    assert second.cached == names
    assert cache.active_blocks == 5  # only the second's partial block is new
    cache.free(first)
    assert cache.active_blocks == 4  # the shared blocks are still in use
    cache.free(second)
    assert cache.active_blocks == 0
    assert cache.prefix_hit(names, 3) == (3, 3)  # kept, idle


def test_the_hit_stops_at_the_first_missing_block_and_at_the_limit() -> None:
    cache = KvCacheV0(16, BLOCK)
    names = hashes(0, 3)
    cache.free(prefill(cache, 8, names[:2]))
    assert cache.prefix_hit(names, 3) == (2, 2)
    assert cache.prefix_hit(names, 1) == (1, 1)
    assert cache.prefix_hit(hashes(100, 2), 2) == (0, 0)


def test_idle_blocks_are_evicted_least_recently_used_first_and_a_sequence_tail_first() -> None:
    cache = recording(KvCacheV0(4, BLOCK))
    old, new = hashes(0, 2), hashes(100, 2)
    cache.free(prefill(cache, 8, old))
    cache.free(prefill(cache, 8, new))
    cache.take_events()
    table = SequenceBlocks()
    assert cache.allocate(table, 4)  # one block: the oldest idle one goes, the tail of `old`
    assert cache.take_events() == [BlockRemoved([old[1]])]
    assert cache.allocate(table, 12)  # two more: `old`'s head, then `new`'s tail
    assert cache.take_events() == [BlockRemoved([old[0], new[1]])]
    assert cache.prefix_hit(new, 2) == (1, 1)


def test_a_hit_makes_a_block_recently_used_again() -> None:
    cache = KvCacheV0(3, BLOCK)
    first, second = hashes(0, 1), hashes(100, 1)
    cache.free(prefill(cache, 4, first))
    cache.free(prefill(cache, 4, second))
    cache.free(prefill(cache, 4, first))  # used again: now `second` is the least recent
    table = SequenceBlocks()
    assert cache.allocate(table, 8)  # one never-used block, then one eviction
    assert cache.prefix_hit(first, 1) == (1, 1)
    assert cache.prefix_hit(second, 1) == (0, 0)


def test_allocation_fails_without_change_when_even_eviction_cannot_make_room() -> None:
    cache = KvCacheV0(4, BLOCK)
    busy = prefill(cache, 12, hashes(0, 3))
    cache.free(prefill(cache, 4, hashes(100, 1)))
    table = SequenceBlocks()
    assert not cache.allocate(table, 8)  # needs 2; 1 idle block is all there is
    assert (table.count, cache.active_blocks, cache.cached_blocks) == (0, 3, 4)
    assert busy.count == 3


def test_the_watermark_keeps_blocks_from_new_sequences() -> None:
    cache = KvCacheV0(100, BLOCK, watermark=0.1)
    assert cache.admission_limit == 90
    prefill(cache, 80 * BLOCK, [])
    assert cache.can_admit(10)
    assert not cache.can_admit(11)
    running = SequenceBlocks()
    assert cache.allocate(running, 15 * BLOCK)  # a running sequence may grow into the watermark


def test_prefix_caching_off_shares_nothing_and_keeps_nothing() -> None:
    cache = recording(KvCacheV0(8, BLOCK, prefix_caching=False))
    names = hashes(0, 2)
    first = prefill(cache, 8, names)
    assert first.cached == [] and first.private == 2
    assert cache.prefix_hit(names, 2) == (0, 0)
    cache.free(first)
    assert (cache.active_blocks, cache.cached_blocks) == (0, 0)
    assert cache.take_events() == []


def test_stored_events_chain_each_block_to_its_parent() -> None:
    cache = recording(KvCacheV0(16, BLOCK))
    names = hashes(0, 3)
    table = SequenceBlocks()
    assert cache.allocate(table, 12)
    cache.commit(table, names, 1)
    cache.commit(table, names, 3)
    assert cache.take_events() == [BlockStored(names, None)]  # one chain, extended as it grew
    other = hashes(0, 2) + sequence_block_hashes(list(range(100, 104)), BLOCK, names[1])
    branch = prefill(cache, 12, other)
    assert branch.cached == other
    assert cache.take_events() == [BlockStored([other[2]], names[1])]


def test_a_block_another_sequence_already_named_is_shared_and_not_stored_twice() -> None:
    cache = recording(KvCacheV0(8, BLOCK))
    names = hashes(0, 1)
    racing = SequenceBlocks()
    assert cache.allocate(racing, 4)  # computing the same block at the same time
    winner = prefill(cache, 4, names)
    assert cache.active_blocks == 2
    cache.commit(racing, names, 1)
    assert racing.cached == names and racing.private == 0
    assert cache.active_blocks == 1  # the duplicate went back
    assert cache.take_events() == [BlockStored(names, None)]
    cache.free(winner)
    cache.free(racing)
    assert cache.active_blocks == 0


def test_reset_drops_idle_blocks_and_says_all_cleared_when_none_is_in_use() -> None:
    cache = recording(KvCacheV0(8, BLOCK))
    cache.free(prefill(cache, 4, hashes(0, 1)))
    in_use = prefill(cache, 4, hashes(100, 1))
    cache.take_events()
    assert cache.reset_prefix_cache() == 1
    assert cache.take_events() == [BlockRemoved(hashes(0, 1))]
    cache.free(in_use)
    assert cache.reset_prefix_cache() == 1
    assert cache.take_events() == [AllCleared()]
    assert cache.cached_blocks == 0


def test_cache_state_lists_every_named_block_in_chains_parents_first() -> None:
    cache = KvCacheV0(16, BLOCK)
    main = hashes(0, 3)
    branch = [*main[:1], *sequence_block_hashes(list(range(200, 204)), BLOCK, main[0])]
    cache.free(prefill(cache, 12, main))
    cache.free(prefill(cache, 8, branch))
    other = hashes(900, 1)
    held = prefill(cache, 5, other)
    assert cache.cache_state() == [
        BlockStored(main, None),
        BlockStored([branch[1]], main[0]),
        BlockStored(other, None),
    ]
    cache.free(held)
