"""The KV cache tier names real engines use, as Flotilla's tiers (runtime/kv/events.py's ``Medium``).

Each engine names the tier a block is kept on in its own words: vLLM ``"GPU"``, ``"CPU"`` (its offloading
connector's host memory) and ``"STORAGE"`` (a tiering backend's files or objects); SGLang's hierarchical cache
``"GPU"``, ``"CPU_TIER1"`` (host memory) and ``"CPU_TIER2"`` (its storage backend); TensorRT-LLM a number,
``cache_level`` 0 for the GPU pool and 1 for the host pool. Dynamo 1.6.1 reads the same names (and some that
no engine here sends yet: ``DEVICE``, ``CPU_PINNED``, ``DISK``, ``NVME``, ``EXTERNAL``, ``NETWORK``, ``REMOTE``,
``SHARED``).

A name Flotilla does not know is read as ``external``, never as the device (Dynamo reads it as the device):
a router that took a block on some new, slower tier for a GPU block would promise a hit that costs a copy. A
missing name (None: an engine or version that names no tier) is the device, the only tier such an engine has.

The device is returned as None, the value Flotilla's events carry for it. ``tier_loads`` is each lower tier's
load report (``WorkerLoad.tiers``) from what the events say the tier holds and what the engine says of its size.
"""

from collections.abc import Iterable, Mapping

from engines.shared.engine_block_names import EngineBlockNames
from runtime.kv.events import LOWER_TIERS, Medium, TierLoad

#: Engine tier names (upper case) and Flotilla's tier for each; None is the device.
TIER_NAMES: dict[str, Medium | None] = {
    "GPU": None,
    "DEVICE": None,
    "CPU": "cpu",  # vLLM's offloading connector
    "CPU_PINNED": "cpu",
    "CPU_TIER1": "cpu",  # SGLang's hierarchical cache, host memory
    "CPU_TIER2": "disk",  # SGLang's hierarchical cache, its storage backend
    "DISK": "disk",
    "NVME": "disk",
    # vLLM's tiering backends (files on a local or shared file system, object stores): Dynamo has no name for
    # it; "disk" is the closer of Flotilla's tiers for the file backend, the one vLLM's docs lead with.
    "STORAGE": "disk",
    "EXTERNAL": "external",
    "NETWORK": "external",
    "REMOTE": "external",
    "SHARED": "external",
}

#: TensorRT-LLM's cache levels: 0 the GPU (primary) pool, 1 the host (secondary) pool; a level it may add
#: later is read as ``external``.
TRTLLM_LEVELS: dict[int, Medium | None] = {0: None, 1: "cpu"}


def tier_of_name(name: object) -> Medium | None:
    """Flotilla's tier for an engine's tier name ("CPU_TIER1" -> "cpu"): None for the device or no name,
    ``external`` for a name (or a value that is no name) Flotilla does not know. Flotilla's own names
    ("gpu", "cpu", "disk", "external") are read as themselves, in any case."""
    if name is None:
        return None
    if not isinstance(name, str):
        return "external"
    return TIER_NAMES.get(name.upper(), "external")


def tier_of_level(cache_level: object) -> Medium | None:
    """Flotilla's tier for TensorRT-LLM's ``cache_level``: None for the GPU pool (0) or no level, "cpu" for
    the host pool (1), ``external`` for any other value."""
    if cache_level is None:
        return None
    if isinstance(cache_level, bool) or not isinstance(cache_level, int):
        return "external"
    return TRTLLM_LEVELS.get(cache_level, "external")


def tier_loads(
    names: EngineBlockNames,
    *,
    offloads_to: Iterable[Medium] = (),
    total_blocks: Mapping[Medium, int | None] | None = None,
    hit_rates: Mapping[Medium, float | None] | None = None,
) -> list[TierLoad] | None:
    """``WorkerLoad.tiers`` for one dp rank: each lower tier the engine is set to offload to (``offloads_to``)
    or that its events put blocks on, best first; None when there is none (the engine offloads nothing).

    ``used_blocks`` is what the rank's events say the tier holds now (``names``: blocks stored there and not
    removed since the worker subscribed), since no engine reports it in its stats; ``total_blocks`` and
    ``hit_rates`` are what the engine's own numbers say, where it has them.
    """
    configured = set(offloads_to)
    totals, rates = total_blocks or {}, hit_rates or {}
    loads = []
    for tier in LOWER_TIERS:
        used = names.held(tier)
        if tier not in configured and not used:
            continue
        total = totals.get(tier)
        loads.append(
            TierLoad(
                medium=tier,
                total_blocks=total,
                used_blocks=used,
                usage=min(used / total, 1.0) if total else None,
                hit_rate=rates.get(tier),
            )
        )
    return loads or None
