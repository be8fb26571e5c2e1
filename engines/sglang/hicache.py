"""SGLang's hierarchical cache (HiCache) as Flotilla's KV tiers: which tiers a worker's ServerArgs turn on,
and how large SGLang makes the host one.

``enable_hierarchical_cache`` keeps pages evicted from the GPU in a host-memory pool (L2, events with medium
``CPU_TIER1``: Flotilla's ``cpu``); ``hicache_storage_backend`` (``file``, ``mooncake``, ``hf3fs``, ``nixl``...)
adds a storage tier below it (L3, ``CPU_TIER2``: Flotilla's ``disk``). The host pool's size is
``hicache_size`` GB when set, else ``hicache_ratio`` (default 2.0) times the device pool's tokens
(``HostKVCache.__init__``, python/sglang/srt/mem_cache/memory_pool_host.py). SGLang's load snapshots say nothing
of these tiers (LoadSnapshot has no host-cache field), so their use comes from the KV events
(engines/shared/kv_tiers.py: ``tier_loads``).
"""

from typing import Any

from runtime.kv.events import Medium

#: SGLang's ``hicache_ratio`` where the arguments do not set it (ServerArgs' default).
DEFAULT_HICACHE_RATIO = 2.0


def hicache_tiers(engine_args: dict[str, Any]) -> tuple[Medium, ...]:
    """The tiers below the GPU that ``engine_args`` turn on: none, ``cpu``, or ``cpu`` and ``disk``."""
    if not engine_args.get("enable_hierarchical_cache"):
        return ()
    return ("cpu", "disk") if engine_args.get("hicache_storage_backend") else ("cpu",)


def host_total_blocks(engine_args: dict[str, Any], device_tokens: int, page_size: int) -> int | None:
    """The host pool's size in pages for a device pool of ``device_tokens``: ``hicache_ratio`` times it; None
    when ``hicache_size`` sets it in GB (its tokens depend on the model's bytes per token, which the worker does
    not know) or when HiCache is off or the device pool is not known yet."""
    if not engine_args.get("enable_hierarchical_cache") or device_tokens <= 0 or engine_args.get("hicache_size"):
        return None
    ratio = float(engine_args.get("hicache_ratio", DEFAULT_HICACHE_RATIO))
    return int(device_tokens * ratio) // page_size
