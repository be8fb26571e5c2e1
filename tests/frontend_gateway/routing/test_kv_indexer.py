"""The KV index: leading-block matches per worker, fed by KV events that may be odd or out of order."""

from frontend_gateway.routing.kv_indexer import KvIndexer, TieredMatch, WorkerBits, leading_matches
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import AllCleared, BlockRemoved, BlockStored

A, B, C = (1, 0), (2, 0), (2, 1)  # workers: (instance id, dp rank); B and C are two ranks of one instance
PROMPT = list(range(100, 164))  # 8 blocks of 8 tokens
HASHES = sequence_block_hashes(PROMPT, 8)


def test_matches_count_the_leading_blocks_each_worker_holds() -> None:
    index = KvIndexer()
    index.apply(A, [BlockStored(HASHES[:8])])
    index.apply(B, [BlockStored(HASHES[:3])])
    index.apply(C, [BlockStored(HASHES[:1])])
    assert index.find_matches(HASHES) == {A: 8, B: 3, C: 1}


def test_a_worker_missing_a_middle_block_matches_only_up_to_it() -> None:
    index = KvIndexer()
    index.apply(A, [BlockStored(HASHES[:2]), BlockStored(HASHES[3:8], parent_hash=HASHES[2])])
    assert index.find_matches(HASHES) == {A: 2}


def test_a_prompt_whose_first_block_nobody_holds_matches_nothing() -> None:
    index = KvIndexer()
    index.apply(A, [BlockStored(HASHES[1:8], parent_hash=HASHES[0])])
    assert index.find_matches(HASHES) == {}
    assert index.find_matches([]) == {}


def test_the_walk_stops_at_the_first_block_nobody_holds() -> None:
    # A holder map that fails the test if the walk reads past the first miss.
    class Watched(dict[int, int]):
        def get(self, key: int, default: object = None) -> object:
            assert key in (HASHES[0], HASHES[1]), "the walk went on after a miss"
            return super().get(key, default)

    bits = WorkerBits()
    holders = Watched({HASHES[0]: bits.bit(A), HASHES[2]: bits.bit(A)})
    assert leading_matches(holders, HASHES, bits) == {A: 1}


def test_a_different_prefix_shares_no_blocks_even_with_equal_later_tokens() -> None:
    index = KvIndexer()
    index.apply(A, [BlockStored(HASHES)])
    other = sequence_block_hashes([7, *PROMPT[1:]], 8)  # first token differs: every chained hash differs
    assert index.find_matches(other) == {}


def test_removed_blocks_and_a_cleared_cache_are_forgotten() -> None:
    index = KvIndexer()
    index.apply(A, [BlockStored(HASHES), BlockRemoved(HASHES[4:])])
    index.apply(B, [BlockStored(HASHES)])
    assert index.find_matches(HASHES) == {A: 4, B: 8}
    index.apply(B, [AllCleared()])
    assert index.find_matches(HASHES) == {A: 4}
    assert index.block_count(B) == 0


def test_blocks_stored_under_a_parent_never_seen_are_kept_as_named() -> None:
    index = KvIndexer()
    index.apply(A, [BlockStored(HASHES[4:], parent_hash=123456789)])
    assert index.block_count(A) == 4
    # Once the leading blocks arrive, the whole chain matches.
    index.apply(A, [BlockStored(HASHES[:4])])
    assert index.find_matches(HASHES) == {A: 8}


def test_duplicate_stores_and_removals_of_unknown_blocks_change_nothing() -> None:
    index = KvIndexer()
    index.apply(A, [BlockStored(HASHES[:4]), BlockStored(HASHES[:4])])
    index.apply(A, [BlockRemoved([1, 2, 3]), BlockRemoved(HASHES[6:])])
    index.apply(B, [BlockRemoved(HASHES)])  # a worker never seen removes blocks
    assert index.find_matches(HASHES) == {A: 4}
    index.apply(A, [BlockRemoved(HASHES[:4])])
    index.apply(A, [BlockRemoved(HASHES[:4])])
    assert index.find_matches(HASHES) == {}
    assert index.workers() == []


def test_a_removal_arriving_before_its_store_leaves_the_store_in_place() -> None:
    # Out of order: the removal refers to a block the index does not have yet, so it is a no-op and the
    # later store wins; the router's gap check asks the worker for its state to settle such cases.
    index = KvIndexer()
    index.apply(A, [BlockRemoved(HASHES[:2])])
    index.apply(A, [BlockStored(HASHES[:2])])
    assert index.find_matches(HASHES) == {A: 2}


def test_replacing_a_workers_state_drops_what_it_no_longer_has() -> None:
    index = KvIndexer()
    index.apply(A, [BlockStored(HASHES)])
    index.apply(B, [BlockStored(HASHES[:2])])
    index.replace(A, [BlockStored(HASHES[:3])])
    assert index.find_matches(HASHES) == {A: 3, B: 2}


def test_removing_an_instance_drops_the_blocks_of_all_its_ranks() -> None:
    index = KvIndexer()
    index.apply(A, [BlockStored(HASHES)])
    index.apply(B, [BlockStored(HASHES)])
    index.apply(C, [BlockStored(HASHES[:5])])
    index.remove_instance(2)
    assert index.find_matches(HASHES) == {A: 8}
    assert index.workers() == [A]


def test_workers_that_leave_give_their_bits_to_newcomers_without_inheriting_blocks() -> None:
    index = KvIndexer()
    index.apply(A, [BlockStored(HASHES)])
    index.apply(B, [BlockStored(HASHES[:4])])
    index.remove_instance(1)  # A leaves; its bit is free
    index.apply(C, [BlockStored(HASHES[:2])])  # C takes A's bit
    assert index.find_matches(HASHES) == {B: 4, C: 2}


def test_worker_bits_name_the_workers_of_a_mask() -> None:
    bits = WorkerBits()
    assert [bits.bit(worker) for worker in (A, B, C)] == [1, 2, 4]
    assert set(bits.workers(1 | 4)) == {A, C}
    bits.release(B)
    assert set(bits.workers(7)) == {A, C}  # a released bit names nobody
    assert bits.bit((9, 0)) == 2  # and is given to the next newcomer
    assert bits.known() == [A, C, (9, 0)]


def test_lower_tier_blocks_extend_a_run_and_are_counted_apart_from_the_device() -> None:
    index = KvIndexer()
    index.apply(A, [BlockStored(HASHES[:3])])
    index.apply(A, [BlockStored(HASHES[2:6], parent_hash=HASHES[1], medium="cpu")])  # 2 also on the device
    index.apply(A, [BlockStored(HASHES[6:7], parent_hash=HASHES[5], medium="disk")])
    index.apply(B, [BlockStored(HASHES[:2], medium="external")])
    assert index.find_matches(HASHES) == {A: 3}  # device blocks only
    assert index.find_tiered(HASHES) == {A: TieredMatch(3, host=3, far=1), B: TieredMatch(0, far=2)}


def test_a_removal_from_one_tier_leaves_the_same_blocks_on_another() -> None:
    index = KvIndexer()
    index.apply(A, [BlockStored(HASHES[:4]), BlockStored(HASHES[:4], medium="cpu")])
    index.apply(A, [BlockRemoved(HASHES[2:4])])  # evicted from the device: the host copies stay
    assert index.find_tiered(HASHES) == {A: TieredMatch(2, host=2)}
    index.apply(A, [BlockRemoved(HASHES[:1], medium="cpu")])  # the host copy of a block still on the device
    assert index.find_tiered(HASHES) == {A: TieredMatch(2, host=2)}
    assert (index.block_count(A), index.block_count(A, "cpu")) == (2, 3)


def test_a_run_ends_at_the_first_block_on_no_tier_for_each_worker() -> None:
    index = KvIndexer()
    index.apply(A, [BlockStored(HASHES[:2]), BlockStored(HASHES[3:5], parent_hash=HASHES[2], medium="cpu")])
    index.apply(B, [BlockStored(HASHES[:1], medium="cpu"), BlockStored(HASHES[1:4], parent_hash=HASHES[0])])
    assert index.find_tiered(HASHES) == {A: TieredMatch(2), B: TieredMatch(3, host=1)}


def test_clearing_a_worker_or_its_instance_forgets_every_tier() -> None:
    index = KvIndexer()
    index.apply(A, [BlockStored(HASHES[:2]), BlockStored(HASHES[2:4], parent_hash=HASHES[1], medium="cpu")])
    index.apply(B, [BlockStored(HASHES[:2], medium="disk")])
    index.apply(A, [AllCleared()])
    assert index.find_tiered(HASHES) == {B: TieredMatch(0, far=2)}
    index.remove_instance(B[0])
    assert index.find_tiered(HASHES) == {}
    assert index.block_count(B, "disk") == 0


def test_tiered_matches_agree_with_device_matches_when_nothing_is_offloaded() -> None:
    index = KvIndexer()
    index.apply(A, [BlockStored(HASHES[:8])])
    index.apply(B, [BlockStored(HASHES[:3])])
    index.apply(C, [BlockStored(HASHES[:1]), BlockStored(HASHES[5:6], parent_hash=HASHES[4], medium="cpu")])
    index.apply(C, [BlockRemoved(HASHES[5:6], medium="cpu")])  # nothing offloaded any more
    expected = {worker: TieredMatch(blocks) for worker, blocks in index.find_matches(HASHES).items()}
    assert index.find_tiered(HASHES) == expected
    # With offloaded blocks elsewhere in the index, the tiered walk gives the same device-only runs.
    index.apply(C, [BlockStored([12345], medium="cpu")])
    assert index.find_tiered(HASHES) == expected
