"""Renaming a real engine's cached blocks with Flotilla's router hashes (engines/shared/engine_block_names.py)."""

import pytest

from engines.shared.engine_block_names import EngineBlockNames
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import AllCleared, BlockRemoved, BlockStored
from runtime.lora import lora_root_hash

TOKENS = list(range(100, 112))  # three blocks of 4


def test_stored_blocks_get_the_names_the_router_computes_from_their_tokens() -> None:
    names = EngineBlockNames(block_size=4)
    stored = names.stored([11, 12], None, TOKENS[:8], lora_id=None)
    assert stored == BlockStored(block_hashes=sequence_block_hashes(TOKENS[:8], 4), parent_hash=None)


def test_an_adapters_blocks_are_named_from_its_root_hash_as_its_router_names_them() -> None:
    names = EngineBlockNames(block_size=4)
    stored = names.stored([21, 22], None, TOKENS[:8], lora_id=7)
    root = lora_root_hash(7)
    assert stored == BlockStored(block_hashes=sequence_block_hashes(TOKENS[:8], 4, root), parent_hash=root, lora_id=7)
    child = names.stored([23], 22, TOKENS[8:], lora_id=7)
    assert child is not None and child.block_hashes == sequence_block_hashes(TOKENS, 4, root)[2:]
    assert set(child.block_hashes).isdisjoint(sequence_block_hashes(TOKENS, 4))


def test_a_child_block_chains_from_its_parents_flotilla_name() -> None:
    names = EngineBlockNames(block_size=4)
    names.stored([11, 12], None, TOKENS[:8])
    child = names.stored([13], 12, TOKENS[8:])
    whole = sequence_block_hashes(TOKENS, 4)
    assert child == BlockStored(block_hashes=[whole[2]], parent_hash=whole[1])


def test_a_block_whose_parent_was_never_heard_is_not_named() -> None:
    names = EngineBlockNames(block_size=4)
    assert names.stored([13], 999, TOKENS[8:]) is None
    assert len(names) == 0


def test_tokens_that_do_not_fill_the_blocks_name_nothing() -> None:
    assert EngineBlockNames(block_size=4).stored([11], None, TOKENS[:3]) is None


def test_removals_name_the_flotilla_hashes_and_forget_the_engines() -> None:
    names = EngineBlockNames(block_size=4)
    names.stored([11, 12], None, TOKENS[:8])
    whole = sequence_block_hashes(TOKENS[:8], 4)
    assert names.removed([12, 77]) == BlockRemoved(block_hashes=[whole[1]])
    assert names.removed([12]) is None
    assert len(names) == 1


def test_a_block_stored_on_the_host_has_the_same_name_as_on_the_device() -> None:
    names = EngineBlockNames(block_size=4)
    on_device = names.stored([11], None, TOKENS[:4])
    on_host = names.stored([11], None, TOKENS[:4], medium="cpu")
    assert on_device is not None and on_host is not None
    assert on_host == BlockStored(block_hashes=on_device.block_hashes, parent_hash=None, medium="cpu")
    assert (names.held(), names.held("cpu")) == (1, 1)


def test_gpu_is_the_device_tier_and_device_events_carry_no_medium() -> None:
    names = EngineBlockNames(block_size=4)
    stored = names.stored([11], None, TOKENS[:4], medium="gpu")
    assert stored is not None and stored.medium is None
    assert names.removed([11], medium=None) == BlockRemoved(block_hashes=stored.block_hashes)


def test_a_removal_from_the_host_drops_the_host_copy_only() -> None:
    names = EngineBlockNames(block_size=4)
    names.stored([11, 12], None, TOKENS[:8])
    names.stored([11, 12], None, TOKENS[:8], medium="cpu")
    whole = sequence_block_hashes(TOKENS[:8], 4)
    assert names.removed([12], medium="cpu") == BlockRemoved(block_hashes=[whole[1]], medium="cpu")
    assert names.removed([12], medium="cpu") is None  # the host no longer holds it
    assert (names.held(), names.held("cpu")) == (2, 1)
    assert names.removed([12]) == BlockRemoved(block_hashes=[whole[1]])  # the device's copy was still there


def test_a_block_on_one_tier_chains_from_a_parent_that_only_another_tier_holds() -> None:
    names = EngineBlockNames(block_size=4)
    names.stored([11], None, TOKENS[:4], medium="cpu")
    whole = sequence_block_hashes(TOKENS, 4)
    assert names.stored([12], 11, TOKENS[4:8]) == BlockStored(block_hashes=[whole[1]], parent_hash=whole[0])
    names.removed([11], medium="cpu")
    assert names.stored([13], 12, TOKENS[8:], medium="disk") == BlockStored(
        block_hashes=[whole[2]], parent_hash=whole[1], medium="disk"
    )


def test_a_block_no_tier_holds_any_more_is_forgotten_and_names_no_child() -> None:
    names = EngineBlockNames(block_size=4)
    names.stored([11], None, TOKENS[:4])
    names.stored([11], None, TOKENS[:4], medium="cpu")
    names.removed([11])
    names.removed([11], medium="cpu")
    assert names.stored([12], 11, TOKENS[4:8]) is None
    assert names.state() == []


def test_a_move_between_tiers_is_a_removal_from_one_and_a_store_on_the_other() -> None:
    names = EngineBlockNames(block_size=4)
    names.stored([11, 12], None, TOKENS[:8])
    whole = sequence_block_hashes(TOKENS[:8], 4)
    assert names.moved(12, None, "cpu") == [
        BlockRemoved(block_hashes=[whole[1]]),
        BlockStored(block_hashes=[whole[1]], parent_hash=whole[0], medium="cpu"),
    ]
    assert (names.held(), names.held("cpu")) == (1, 1)
    assert names.moved(12, "cpu", "cpu") == []
    assert names.moved(99, None, "cpu") == []  # never named


def test_a_removal_that_names_no_tier_drops_the_block_from_every_tier_that_holds_it() -> None:
    names = EngineBlockNames(block_size=4)
    names.stored([11, 12], None, TOKENS[:8])
    names.moved(12, None, "cpu")
    whole = sequence_block_hashes(TOKENS[:8], 4)
    assert names.removed_everywhere([11, 12]) == [
        BlockRemoved(block_hashes=[whole[0]]),
        BlockRemoved(block_hashes=[whole[1]], medium="cpu"),
    ]
    assert names.state() == []


def test_the_state_lists_every_tiers_blocks_with_their_medium_each_after_its_parent() -> None:
    names = EngineBlockNames(block_size=4)
    whole = sequence_block_hashes(TOKENS, 4)
    names.stored([11], None, TOKENS[:4], medium="cpu")
    names.stored([12, 13], 11, TOKENS[4:])
    names.stored([11], None, TOKENS[:4])  # the parent reaches the device after its children
    assert names.state() == [
        BlockStored(block_hashes=[whole[0]], parent_hash=None),
        BlockStored(block_hashes=[whole[0]], parent_hash=None, medium="cpu"),
        BlockStored(block_hashes=[whole[1]], parent_hash=whole[0]),
        BlockStored(block_hashes=[whole[2]], parent_hash=whole[1]),
    ]


def test_a_clear_forgets_every_tier() -> None:
    names = EngineBlockNames(block_size=4)
    names.stored([11], None, TOKENS[:4])
    names.stored([11], None, TOKENS[:4], medium="disk")
    assert names.cleared() == AllCleared()
    assert (names.held(), names.held("disk"), names.state()) == (0, 0, [])


def test_a_block_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="block_size"):
        EngineBlockNames(block_size=0)
