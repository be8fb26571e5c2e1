"""A prompt's images are named in the KV blocks that hold them: the router's names for a request and the names a
worker gives vLLM's stored blocks (with their extra keys) agree, and two images never share a block's name."""

from engines.shared.engine_block_names import EngineBlockNames
from engines.shared.zmq_kv_events import translate_batch
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import BlockStored
from runtime.kv.image_blocks import request_block_hashes
from runtime.protocol import ImageInput

IMAGE = 99  # the placeholder token
BLOCK = 4
# "a b <image> c d e f g h i": one placeholder, widened by the engine to 6 tokens.
PROMPT = [10, 11, IMAGE, 12, 13, 14, 15, 16, 17, 18]


def image(digest: str, tokens: int = 6, position: int = 2) -> ImageInput:
    return ImageInput(data=b"", digest=digest, position=position, tokens=tokens)


def test_the_same_text_with_different_images_differs_from_the_first_block_holding_an_image() -> None:
    red = request_block_hashes(PROMPT, [image("red")], BLOCK)
    blue = request_block_hashes(PROMPT, [image("blue")], BLOCK)
    assert len(red) == len(blue) == 15 // BLOCK
    # Block 0 already holds the image's first placeholders: named apart, and every block after it too.
    assert all(one != other for one, other in zip(red, blue, strict=True))


def test_the_same_image_gives_the_same_names() -> None:
    assert request_block_hashes(PROMPT, [image("red")], BLOCK) == request_block_hashes(PROMPT, [image("red")], BLOCK)


def test_blocks_before_the_image_are_named_as_text_is() -> None:
    prompt = [1, 2, 3, 4, *PROMPT]
    named = request_block_hashes(prompt, [image("red", position=6)], BLOCK)
    assert named[0] == sequence_block_hashes(prompt, BLOCK)[0]
    # Widened placeholders alone (no image named) are not the image's blocks.
    widened = [1, 2, 3, 4, 10, 11, *[IMAGE] * 6, 12, 13, 14, 15, 16, 17, 18]
    assert named[1:] != sequence_block_hashes(widened, BLOCK)[1 : len(named)]


def test_an_image_of_unknown_size_names_only_the_blocks_before_it() -> None:
    prompt = [1, 2, 3, 4, 5, *PROMPT]
    named = request_block_hashes(prompt, [image("red", tokens=0, position=7)], BLOCK)
    assert named == sequence_block_hashes(prompt[:7], BLOCK)


def test_a_vllm_stored_event_with_the_images_keys_gets_the_routers_names() -> None:
    # What vLLM publishes for PROMPT's first two blocks: the widened tokens, and per block the image's
    # (uuid, offset from the block's start) pair, the uuid being the digest the gateway gave it.
    widened = [10, 11, *[IMAGE] * 6]
    event = {
        "type": "BlockStored", "block_hashes": [501, 502], "parent_block_hash": None, "token_ids": widened,
        "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None,
        "extra_keys": [[["red", 2]], [["red", -2]]], "group_idx": 0, "kv_cache_spec_kind": "full_attention",
    }  # fmt: skip
    names = EngineBlockNames(BLOCK)
    events = translate_batch([1.0, [event], 0], names)
    expected = request_block_hashes(PROMPT, [image("red")], BLOCK)[:2]
    assert events == [BlockStored(block_hashes=expected, parent_hash=None)]
