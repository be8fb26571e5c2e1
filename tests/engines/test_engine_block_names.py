"""Renaming a real engine's cached blocks with Flotilla's router hashes (engines/shared/engine_block_names.py)."""

import pytest

from engines.shared.engine_block_names import EngineBlockNames
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import AllCleared, BlockRemoved, BlockStored

TOKENS = list(range(100, 112))  # three blocks of 4


def test_stored_blocks_get_the_names_the_router_computes_from_their_tokens() -> None:
    names = EngineBlockNames(block_size=4)
    stored = names.stored([11, 12], None, TOKENS[:8], lora_id=None)
    assert stored == BlockStored(block_hashes=sequence_block_hashes(TOKENS[:8], 4), parent_hash=None)


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


def test_blocks_off_the_gpu_are_reported_with_their_tier_but_not_mapped() -> None:
    names = EngineBlockNames(block_size=4)
    stored = names.stored([11], None, TOKENS[:4], medium="cpu")
    assert stored is not None and stored.medium == "cpu"
    assert len(names) == 0
    assert names.removed([11], medium="cpu") is None


def test_the_state_lists_every_block_parents_first_and_a_clear_empties_it() -> None:
    names = EngineBlockNames(block_size=4)
    names.stored([11, 12], None, TOKENS[:8])
    names.stored([13], 12, TOKENS[8:])
    whole = sequence_block_hashes(TOKENS, 4)
    assert names.state() == [
        BlockStored(block_hashes=[whole[0]], parent_hash=None),
        BlockStored(block_hashes=[whole[1]], parent_hash=whole[0]),
        BlockStored(block_hashes=[whole[2]], parent_hash=whole[1]),
    ]
    assert names.cleared() == AllCleared()
    assert names.state() == []


def test_a_block_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="block_size"):
        EngineBlockNames(block_size=0)
