"""A pipeline's host-memory KV tier as each engine's own settings: a pure translation, no database.

``host_tier_args(engine, engine_args, host_gib, gpus_per_replica)`` gives the engine args that size a replica's
tier of ``host_gib`` GiB of host memory, to lay over the group's own (empty when the pipeline has no tier):

* mocker: ``num_host_blocks``, the tier in blocks per dp rank: GiB × 2^30 ÷ (``kv_bytes_per_token`` ×
  ``block_size``), split over the replica's ``dp_size`` ranks (each keeps its own tier, as each keeps its own
  ``num_gpu_blocks``), rounded down. The engine args must give ``kv_bytes_per_token``: there is no default
  a block's size could honestly be read from.
* vLLM: ``kv_offloading_size`` in GiB (vLLM's total over a replica's tensor-parallel ranks) and
  ``kv_offloading_backend`` ``native`` (unless the engine args name another backend).
* SGLang: ``enable_hierarchical_cache`` and ``hicache_size``, in whole GB (10^9 bytes) per GPU: each
  tensor-parallel rank keeps its own pool, so the replica's tier is split over its GPUs, rounded down
  (never more than placement reserved).
* Any other engine has no host tier Flotilla can size: refused.

The engine args may not set a key the tier sets (two places to size one tier would disagree).
"""

import math
from collections.abc import Mapping
from typing import Any

from controlplane.errors import ControlPlaneError

GIB = 1 << 30
#: The mocker's block size when its engine args do not give one (engines/mocker/config.py ``block_size``;
#: the control plane does not import engines, so a test holds the two to the same value).
MOCKER_DEFAULT_BLOCK_SIZE = 64
#: SGLang's ``hicache_size`` unit: a decimal gigabyte.
SGLANG_GB = 10**9
#: The engines that keep a host tier, and the engine-arg keys the tier owns in each.
HOST_TIER_KEYS: dict[str, tuple[str, ...]] = {
    "mocker": ("num_host_blocks",),
    "vllm": ("kv_offloading_size",),
    "sglang": ("hicache_size", "hicache_ratio"),
}
HOST_TIER_ENGINES = tuple(HOST_TIER_KEYS)


class HostTierRefused(ControlPlaneError):
    """The engine (or its args) cannot take the host tier asked for; the message says what to change."""


def host_tier_args(
    engine: str, engine_args: Mapping[str, Any], host_gib: float | None, gpus_per_replica: int
) -> dict[str, Any]:
    """The engine args that give one replica ``host_gib`` GiB of host KV tier ({} for 0 or None).

    ``engine_args`` are the group's merged over its model's defaults. Raises HostTierRefused.
    """
    if not host_gib:
        return {}
    owned = HOST_TIER_KEYS.get(engine)
    if owned is None:
        raise HostTierRefused(
            f"{engine} keeps no KV cache tier in host memory; engines that do: {', '.join(HOST_TIER_ENGINES)} "
            "(or set kv_host_cache_gib to 0)"
        )
    for key in owned:
        if key in engine_args:
            raise HostTierRefused(f"engine args set {key!r}, which kv_host_cache_gib sets for {engine}: drop it")
    tier_bytes = host_gib * GIB
    if engine == "mocker":
        return _mocker(engine_args, tier_bytes)
    if engine == "vllm":
        return {
            "kv_offloading_backend": engine_args.get("kv_offloading_backend", "native"),
            "kv_offloading_size": host_gib,
        }
    return _sglang(engine_args, tier_bytes, max(1, gpus_per_replica))


def _mocker(engine_args: Mapping[str, Any], tier_bytes: float) -> dict[str, Any]:
    bytes_per_token = engine_args.get("kv_bytes_per_token")
    if bytes_per_token is None:
        raise HostTierRefused(
            "the mocker counts its host tier in blocks: its engine args need 'kv_bytes_per_token' (bytes of KV "
            "cache per token: layers × 2 × KV heads × head size × dtype bytes; SmolLM2-135M in bf16: 23040)"
        )
    block_size = engine_args.get("block_size", MOCKER_DEFAULT_BLOCK_SIZE)
    ranks = engine_args.get("dp_size", 1)
    for key, value in (("kv_bytes_per_token", bytes_per_token), ("block_size", block_size), ("dp_size", ranks)):
        if not _positive_int(value):
            raise HostTierRefused(f"engine args' {key!r} must be a whole number above 0, not {value!r}")
    block_bytes = bytes_per_token * block_size
    blocks = math.floor(tier_bytes / (block_bytes * ranks))
    if blocks < 1:
        raise HostTierRefused(
            f"a host tier of {tier_bytes / GIB:g} GiB holds no block of {block_bytes} bytes per dp rank "
            f"({ranks} rank(s)): give at least {block_bytes * ranks / GIB:.6g} GiB"
        )
    return {"num_host_blocks": blocks}


def _sglang(engine_args: Mapping[str, Any], tier_bytes: float, gpus: int) -> dict[str, Any]:
    if engine_args.get("enable_hierarchical_cache") is False:
        raise HostTierRefused("engine args turn enable_hierarchical_cache off, which SGLang's host tier needs")
    per_gpu_gb = math.floor(tier_bytes / gpus / SGLANG_GB)
    if per_gpu_gb < 1:
        # hicache_size 0 would mean "a multiple of the device pool" (hicache_ratio) to SGLang, not "none".
        raise HostTierRefused(
            f"SGLang sizes its host tier in whole GB per GPU: {gpus} GPU(s) need at least "
            f"{gpus * SGLANG_GB / GIB:.3g} GiB"
        )
    return {"enable_hierarchical_cache": True, "hicache_size": per_gpu_gb}


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
