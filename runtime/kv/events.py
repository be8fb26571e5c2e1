"""What engines tell routers about their KV caches and load, and how an engine hands it over.

KV events name blocks by their sequence hash (runtime/kv/blocks.py). A worker publishes them in
batches on its component's ``kv_events`` subject (msgpack); ``event_id`` counts batches per
(instance, dp rank) from 1 so that a router can see a gap (a lost or reordered batch) and ask the
worker for its whole cache state instead (``KvStateRequest`` on the instance's ``kv_state``
subject, answered with one batch of ``BlockStored`` events that describes every cached block).

Load is published once a second per dp rank on the component's ``load_metrics`` subject (JSON, so
that ``nats sub`` shows it to a person) as ``WorkerLoad``.

An engine takes part by implementing ``KvEventSource``: the worker gives it a ``KvEventSink`` before
it starts serving, asks it for ``load()`` every second, and for ``cache_state()`` when a router
asks. Engines that do not implement it publish only their active request count.
"""

from typing import Literal, Protocol, runtime_checkable

import msgspec

#: The tier a block is kept on, for engines that offload (vLLM's ``medium``, SGLang's, TensorRT-LLM's cache
#: level): ``gpu`` the device's memory (None says the same: the engine's only tier), ``cpu`` the host's memory,
#: ``disk`` a local disk, ``external`` a store outside the node (a name an engine uses that Flotilla does not
#: know is read as ``external``, never as the device). A router credits a hit on a lower tier below a device
#: hit (routing/kv_scoring.py): bringing the blocks back costs a copy, not a prefill.
Medium = Literal["gpu", "cpu", "disk", "external"]
#: The tiers below the device, best first.
LOWER_TIERS: tuple[Medium, ...] = ("cpu", "disk", "external")


class BlockStored(msgspec.Struct, tag="stored", array_like=True):
    """Blocks now cached, in prefix order: ``parent_hash`` is the block before the first (None: none).

    The optional fields are what real engines say of a block, so that LoRA adapters, per-request cache
    salts and offload tiers need no new wire format (trailing optional fields: a message without them
    still decodes). ``token_ids`` are the blocks' tokens, for a router that names blocks itself
    (re-hashing them); ``lora_id`` the adapter and ``salt`` the request's cache salt the blocks were
    computed with (None: the base model, unsalted), each making a block that only requests with the same
    adapter or salt can reuse; ``medium`` the tier the blocks are kept on.
    """

    block_hashes: list[int]
    parent_hash: int | None = None
    token_ids: list[int] | None = None
    lora_id: int | None = None
    medium: Medium | None = None
    salt: str | None = None


class BlockRemoved(msgspec.Struct, tag="removed", array_like=True):
    """Blocks evicted from the cache (from ``medium``'s tier: None, the GPU)."""

    block_hashes: list[int]
    medium: Medium | None = None


class AllCleared(msgspec.Struct, tag="cleared", array_like=True):
    """The whole cache was dropped (a reset)."""


KvEvent = BlockStored | BlockRemoved | AllCleared


class KvEventBatch(msgspec.Struct, kw_only=True):
    """The events of one instance's dp rank since its previous batch, in order; or, with ``event_id`` 0,
    (part of) an answer to a ``KvStateRequest``: every block the rank holds."""

    instance_id: int
    dp_rank: int = 0
    event_id: int  # 1, 2, 3 ... per (instance_id, dp_rank); 0 for a whole-state answer
    events: list[KvEvent]
    #: A state answer's place among its parts: part ``part`` (from 0) of ``parts``. An answer larger than a
    #: NATS message is sent in parts (the first as the reply, the others to ``KvStateRequest.parts_to``).
    part: int = 0
    parts: int = 1
    #: A state answer covers every batch of its rank up to this ``event_id`` (0: none yet); None from a
    #: publisher that does not say. Batches after it that a router heard first are applied after the answer.
    covers_event_id: int | None = None


class KvStateRequest(msgspec.Struct, kw_only=True):
    """A router's request for a worker's whole cache state (after it started, or saw a gap)."""

    dp_rank: int | None = None  # None: every rank
    #: Where the parts of the answer after the first go (a subject the asking router listens on).
    parts_to: str | None = None


class TierLoad(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One KV tier below the device of one dp rank (``WorkerLoad.tiers``): its size, use and hits."""

    medium: Medium
    total_blocks: int | None = None
    used_blocks: int | None = None  # blocks it holds now
    usage: float | None = None  # used / total, 0..1
    # Share of the prompt tokens over the last period that were found on this tier (and not on the device)
    # and brought back instead of computed, 0..1.
    hit_rate: float | None = None
    # Counters since the engine started: blocks copied to this tier, and blocks brought back from it.
    offloaded_blocks: int | None = None
    onboarded_blocks: int | None = None


class WorkerLoad(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One dp rank of one instance at one moment."""

    instance_id: int
    dp_rank: int = 0
    active_requests: int  # taken and not finished: running plus waiting
    running: int | None = None
    waiting: int | None = None
    kv_active_blocks: int | None = None  # blocks held by running requests
    kv_total_blocks: int | None = None
    kv_usage: float | None = None  # fraction of blocks in use, 0..1
    prefix_hit_rate: float | None = None  # of prompt tokens over the last period, 0..1
    # Output tokens produced since the engine started: a counter, whose differences give tokens/s.
    generated_tokens: int | None = None
    # Running requests evicted to free KV blocks since the engine started (a counter).
    preemptions: int | None = None
    # Disaggregated serving, counters since the worker started (on rank 0's report; None: none served):
    # prompts computed for a decode worker (prefill-only requests) and their seconds from arrival to handoff,
    prefills: int | None = None
    prefill_seconds: float | None = None
    # and requests taken with a prefill worker's KV handoff and their seconds from arrival to first token.
    handoffs: int | None = None
    handoff_first_token_seconds: float | None = None
    # KV cache tiers below the device (host memory, disk), best first; None: the engine offloads nothing.
    tiers: list[TierLoad] | None = None


class KvEventSink(Protocol):
    """Where an engine puts its KV events; never blocks (the worker batches and publishes them)."""

    def publish(self, dp_rank: int, events: list[KvEvent]) -> None: ...


@runtime_checkable
class KvEventSource(Protocol):
    """An engine that reports its KV cache: events as they happen, state and load when asked."""

    def attach_kv_events(self, sink: KvEventSink) -> None:
        """Called once, before the first request; events go to ``sink`` from then on."""
        ...

    def load(self) -> list[WorkerLoad]:
        """The load of each dp rank now (``instance_id`` 0: the worker fills it in)."""
        ...

    def cache_state(self, dp_rank: int | None) -> dict[int, list[BlockStored]]:
        """Every cached block of ``dp_rank`` (None: every rank), by rank, as stored events in prefix order."""
        ...
