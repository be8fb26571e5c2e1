"""Naming the KV blocks of a prompt with images: each image's digest mixed into the blocks that hold it.

A vision model's prompt holds an image as a run of placeholder tokens, the same for every image: named by their
tokens alone, the blocks of two different images would be the same blocks, and a router would send a request to
a worker that holds the other image's KV (a cache hit the engine itself would not take). So a block that holds
part of an image is named by its tokens *and* its extra keys, as vLLM names its blocks
(``vllm/v1/core/kv_cache_utils.py``, ``_gen_mm_extra_hash_keys``): one ``(identifier, offset)`` pair per image
the block overlaps, ``offset`` where the image starts relative to the block's first token (negative when it
started in an earlier block). vLLM publishes these pairs with each stored block (``BlockStored.extra_keys``), and
the image's identifier is the digest the gateway computed, given to vLLM as the item's uuid: a worker's event and
a router's request name the same blocks the same way (engines/shared/engine_block_names.py re-hashes the
events' tokens and keys with ``keyed_sequence_hashes``).

The keys are mixed in by hashing the block's tokens followed by the keys' bytes (each identifier length-prefixed,
each offset a signed 64-bit integer), so that a block without keys is named exactly as runtime/kv/blocks.py names
it. Keys other than image pairs (a LoRA name, a cache salt: Flotilla sends vLLM neither) are mixed in too, so a
block that has them never takes the name of one that does not.
"""

import struct
from array import array
from collections.abc import Sequence
from typing import Any

import msgspec
import xxhash

from runtime.kv.blocks import HASH_SEED, sequence_block_hashes
from runtime.protocol import ImageInput

#: A block's extra keys, as vLLM's events carry them: image pairs (identifier, offset), maybe other values.
BlockKeys = Sequence[Any]
_PAIR = struct.Struct("<QQ")
_OFFSET = struct.Struct("<q")
_LENGTH = struct.Struct("<I")


def key_bytes(keys: BlockKeys) -> bytes:
    """The bytes a block's extra keys add to what its local hash covers."""
    parts: list[bytes] = []
    for key in keys:
        if isinstance(key, list | tuple) and len(key) == 2 and isinstance(key[0], str) and type(key[1]) is int:
            identifier = key[0].encode()
            parts += (b"m", _LENGTH.pack(len(identifier)), identifier, _OFFSET.pack(key[1]))
        else:
            other = msgspec.msgpack.encode(key)
            parts += (b"o", _LENGTH.pack(len(other)), other)
    return b"".join(parts)


def keyed_sequence_hashes(
    tokens: Sequence[int], block_size: int, keys: Sequence[BlockKeys | None] | None, parent: int | None = None
) -> list[int]:
    """The sequence hash of each full block of ``tokens``, chained from ``parent``, each block's local hash also
    covering its extra keys (``keys[i]``: block i's; None or empty: none, as ``sequence_block_hashes`` names it)."""
    if not keys or not any(keys):
        return sequence_block_hashes(tokens, block_size, parent)
    full = len(tokens) - len(tokens) % block_size
    data = array("I", tokens[:full]).tobytes()
    step = block_size * 4
    hash64 = xxhash.xxh3_64_intdigest
    hashes: list[int] = []
    for index, start in enumerate(range(0, full * 4, step)):
        block = data[start : start + step]
        extra = keys[index] if index < len(keys) else None
        local = hash64(block + key_bytes(extra) if extra else block, seed=HASH_SEED)
        parent = local if parent is None else hash64(_PAIR.pack(parent, local), seed=HASH_SEED)
        hashes.append(parent)
    return hashes


def image_keys(spans: Sequence[tuple[str, int, int]], blocks: int, block_size: int) -> list[list[tuple[str, int]]]:
    """Each block's image pairs, vLLM's rule: for every image (identifier, first token, length) the block
    overlaps, its identifier and where it starts relative to the block."""
    keys: list[list[tuple[str, int]]] = [[] for _ in range(blocks)]
    for identifier, offset, length in spans:
        if length < 1:
            continue
        first, last = offset // block_size, min((offset + length - 1) // block_size, blocks - 1)
        for block in range(first, last + 1):
            keys[block].append((identifier, offset - block * block_size))
    return keys


def request_block_hashes(
    token_ids: Sequence[int], images: Sequence[ImageInput] | None, block_size: int, parent: int | None = None
) -> list[int]:
    """The sequence hashes a router looks a request's prompt up by, as the engine will name its blocks; chained
    from ``parent`` (a LoRA adapter's root hash, runtime/lora.py; None: the base model's blocks).

    Each image's placeholder is widened to the tokens the engine makes of it, and the blocks holding them carry
    the image's pair. When the gateway does not know how many tokens an image becomes (``tokens`` 0), only the
    blocks before the first image are named: those after it are where the engine puts them, unknown here.
    """
    if not images:
        return sequence_block_hashes(token_ids, block_size, parent)
    if any(image.tokens < 1 for image in images):
        return sequence_block_hashes(token_ids[: min(image.position for image in images)], block_size, parent)
    widened: list[int] = []
    spans: list[tuple[str, int, int]] = []
    start = 0
    for image in sorted(images, key=lambda image: image.position):
        widened += token_ids[start : image.position]
        spans.append((image.digest, len(widened), image.tokens))
        widened += [token_ids[image.position]] * image.tokens
        start = image.position + 1
    widened += token_ids[start:]
    blocks = len(widened) // block_size
    return keyed_sequence_hashes(widened, block_size, image_keys(spans, blocks, block_size), parent)
