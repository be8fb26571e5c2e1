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

The device is returned as None, the value Flotilla's events carry for it.
"""

from runtime.kv.events import Medium

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
