"""TensorRT-LLM's KV events, as Flotilla's.

With ``KvCacheConfig(event_buffer_max_size=N)`` the ``LLM`` keeps its KV cache manager's events, and
``LLM.get_kv_cache_events_async(timeout)`` yields them as dicts, shaped by ``KVCacheEventSerializer``
(``tensorrt_llm/_utils.py``, read at NVIDIA/TensorRT-LLM commit fcd3f316)::

    {"event_id": int, "window_size": int, "attention_dp_rank": int (with attention DP only),
     "data": {"type": "created", "num_blocks_per_cache_level": [...]}
           | {"type": "stored", "parent_hash": int | None,
              "blocks": [{"type": "stored_block", "block_hash": int,
                          "tokens": [{"type": "unique_token", "token_id": int, "token_extra_id": int}, ...],
                          "cache_level": int, "priority": int, "lora_id": int (not serialized yet)}, ...]}
           | {"type": "removed", "block_hashes": [int, ...]}
           | {"type": "updated", "block_hash": int,
              "cache_level": {"type": "event_diff", "old_value": int, "new_value": int} | None,
              "priority": {...} | None}}

``cache_level`` 0 is the GPU (primary) pool, 1 the host (secondary, offload) pool (engines/shared/kv_tiers.py;
a level Flotilla does not know is ``external``). TensorRT-LLM moves a block between the pools rather than
copying it: an ``updated`` event whose cache level changes (0 to 1 when it offloads a block, 1 to 0 when it
brings one back) is the block's removal from the old tier and its store on the new one. ``created`` says
nothing about blocks: it is read only for the host pool's size (``host_pool_blocks``), which the load report's
``cpu`` tier gives.

Partial blocks: with partial reuse (``KvCacheConfig.enable_partial_reuse``, on by default) a stored event's last
block may hold fewer than ``tokens_per_block`` tokens. The router names full blocks only, so the run stops there
and its full blocks keep their names, as Dynamo's TensorRT-LLM publisher does (``Publisher._handle_kv_event``);
a later removal of the partial block names nothing and says nothing.

Sliding-window models (Gemma, gpt-oss): TensorRT-LLM keeps one block pool per attention window, and every event
carries its pool's ``window_size``. Only the full-attention pool (the largest window) says which prefixes are
cached for the whole model; the others' blocks (and their removals, which may name the same hashes) are left out
(``FullAttentionPool``), as Dynamo's publisher does (``Publisher.should_drop_event``).
"""

from typing import Any

from engines.shared.engine_block_names import EngineBlockNames
from engines.shared.kv_tiers import tier_of_level
from runtime.kv.events import KvEvent, Medium


def host_pool_blocks(event: dict[str, Any]) -> int | None:
    """The host (secondary) pool's size in blocks that a ``created`` event announces, or None for any other event
    (or a cache without a host pool: 0 blocks)."""
    data = event.get("data")
    if not isinstance(data, dict) or data.get("type") != "created":
        return None
    levels = data.get("num_blocks_per_cache_level")
    if not isinstance(levels, list) or len(levels) < 2 or not isinstance(levels[1], int):
        return None
    return levels[1] or None


class FullAttentionPool:
    """Which of TensorRT-LLM's KV events are the full-attention pool's: the pool of the largest ``window_size``
    its first ``created`` events announce (one per pool, before any other event)."""

    def __init__(self) -> None:
        #: The full-attention pool's window; None until a ``created`` event names one.
        self.window_size: int | None = None
        self._settled = False

    def keeps(self, event: dict[str, Any]) -> bool:
        """Whether ``event`` is the full-attention pool's. A ``created`` event among the first is kept when its
        window is the largest yet (its host pool is the one the load report gives); an event without a
        ``window_size`` (TensorRT-LLM before it had one) or before any window is known is kept."""
        size = event.get("window_size")
        if not isinstance(size, int):
            return True
        data = event.get("data")
        if isinstance(data, dict) and data.get("type") == "created" and not self._settled:
            if self.window_size is None or size >= self.window_size:
                self.window_size = size
                return True
            return False
        self._settled = True
        return self.window_size is None or size == self.window_size


def translate_event(event: dict[str, Any], names: EngineBlockNames) -> list[KvEvent]:
    """Flotilla's events for one of TensorRT-LLM's event dicts (none for what names nothing routable)."""
    data = event.get("data")
    if not isinstance(data, dict):
        return []
    kind = data.get("type")
    if kind == "stored":
        return _stored(data, names)
    if kind == "removed":
        # A removal names no level: the block goes from whichever pool holds it.
        return list(names.removed_everywhere(data.get("block_hashes") or []))
    if kind == "updated":
        level = data.get("cache_level")
        if isinstance(level, dict) and "block_hash" in data:
            source, target = tier_of_level(level.get("old_value")), tier_of_level(level.get("new_value"))
            return names.moved(data["block_hash"], source, target)
    return []


def _stored(data: dict[str, Any], names: EngineBlockNames) -> list[KvEvent]:
    # One Flotilla event per run of blocks on the same tier and adapter: a stored event's blocks chain
    # from its parent, each from the one before.
    events: list[KvEvent] = []
    parent = data.get("parent_hash")
    run_hashes: list[int] = []
    run_tokens: list[int] = []
    run_key: tuple[int | None, Medium | None] | None = None

    def flush() -> bool:
        if not run_hashes or run_key is None:
            return True
        stored = names.stored(run_hashes, parent, run_tokens, lora_id=run_key[0], medium=run_key[1])
        if stored is None:
            return False
        events.append(stored)
        return True

    for block in data.get("blocks") or []:
        tokens = [token["token_id"] for token in block.get("tokens") or []]
        if len(tokens) != names.block_size:
            break  # a partial block ends the event's chain; the full blocks before it stand
        key = (block.get("lora_id"), tier_of_level(block.get("cache_level")))
        if run_key is not None and key != run_key:
            if not flush():
                return events  # the rest chain from a block that could not be named
            parent = run_hashes[-1]
            run_hashes, run_tokens = [], []
        run_key = key
        run_hashes.append(block["block_hash"])
        run_tokens.extend(tokens)
    flush()
    return events


def translate_events(
    events: list[dict[str, Any]], names_by_rank: dict[int, EngineBlockNames]
) -> dict[int, list[KvEvent]]:
    """Flotilla's events for a list of TensorRT-LLM's, by attention-DP rank (0 without attention DP), in
    order; ranks with no names map are skipped."""
    translated: dict[int, list[KvEvent]] = {}
    for event in events:
        rank = event.get("attention_dp_rank") or 0
        names = names_by_rank.get(rank)
        if names is None:
            continue
        if flotilla_events := translate_event(event, names):
            translated.setdefault(rank, []).extend(flotilla_events)
    return translated
