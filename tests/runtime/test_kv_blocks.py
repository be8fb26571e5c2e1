"""Block naming: full blocks only, chained so that equal hashes mean equal prefixes."""

from runtime.kv.blocks import chain_hash, local_block_hashes, sequence_block_hashes


def test_only_full_blocks_are_named() -> None:
    assert local_block_hashes(list(range(7)), 4) == local_block_hashes(list(range(4)), 4)
    assert len(local_block_hashes(list(range(8)), 4)) == 2
    assert local_block_hashes([1, 2, 3], 4) == []


def test_a_local_hash_depends_on_its_own_tokens_only() -> None:
    first = local_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    second = local_block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert first[1] == second[1]
    assert first[0] != second[0]


def test_a_sequence_hash_names_the_whole_prefix() -> None:
    first = sequence_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    second = sequence_block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert first[1] != second[1]  # same tokens in block 1, different prefixes
    shared = sequence_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0], 4)
    assert shared[:2] == first


def test_hashes_chain_from_a_given_parent() -> None:
    whole = sequence_block_hashes(list(range(12)), 4)
    assert sequence_block_hashes(list(range(4, 12)), 4, parent=whole[0]) == whole[1:]
    assert whole[1] == chain_hash(whole[0], local_block_hashes(list(range(4, 8)), 4)[0])


def test_token_ids_beyond_16_bits_are_hashed_in_full() -> None:
    assert local_block_hashes([70_000, 1], 2) != local_block_hashes([70_000 - 65_536, 1], 2)
