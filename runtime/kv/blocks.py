"""Naming KV-cache blocks by their tokens: the hash both engines and routers compute.

A sequence's tokens are cut into blocks of ``block_size`` tokens; only full blocks are named. A
block's *local* hash covers its own tokens; its *sequence* hash chains the parent's sequence hash
with the local one, so equal sequence hashes mean equal whole prefixes. Engines name the blocks they
cache this way in their KV events, and the KV router names a request's blocks the same way to ask
which worker already holds the longest prefix of them (frontend_gateway's KV indexer).

xxHash3 (64-bit, seed 1337) over the tokens as little-endian uint32, as NVIDIA Dynamo hashes blocks.
"""

import struct
from array import array
from collections.abc import Sequence

import xxhash

HASH_SEED = 1337
_BYTES_PER_HASH = 8


def local_block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The local hash of each full block of ``tokens`` (a trailing partial block is not named)."""
    full = len(tokens) - len(tokens) % block_size
    if full == 0:
        return []
    data = array("I", tokens[:full]).tobytes()  # uint32, native order: little-endian on x86 and ARM
    step = block_size * 4
    hash64 = xxhash.xxh3_64_intdigest
    return [hash64(data[start : start + step], seed=HASH_SEED) for start in range(0, len(data), step)]


def chain_hash(parent: int | None, local: int) -> int:
    """The sequence hash of a block whose local hash is ``local`` after the block named ``parent``."""
    if parent is None:
        return local
    data = parent.to_bytes(_BYTES_PER_HASH, "little") + local.to_bytes(_BYTES_PER_HASH, "little")
    return xxhash.xxh3_64_intdigest(data, seed=HASH_SEED)


def sequence_block_hashes(tokens: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """The sequence hash of each full block of ``tokens``, chained from ``parent`` (None: the start).

    The same as chaining ``local_block_hashes`` with ``chain_hash``, in one loop: the router runs this
    for every request (an 8k-token prompt is 128 blocks of 64).
    """
    full = len(tokens) - len(tokens) % block_size
    if full == 0:
        return []
    data = memoryview(array("I", tokens[:full])).cast("B")
    step = block_size * 4
    hash64 = xxhash.xxh3_64_intdigest
    pair = _PAIR.pack
    hashes: list[int] = []
    for start in range(0, full * 4, step):
        local = hash64(data[start : start + step], seed=HASH_SEED)
        parent = local if parent is None else hash64(pair(parent, local), seed=HASH_SEED)
        hashes.append(parent)
    return hashes


# A (parent, local) pair as chain_hash lays it out: two little-endian uint64.
_PAIR = struct.Struct("<QQ")
