"""The KV events SGLang and vLLM publish over ZMQ (one format: SGLang took vLLM's), as Flotilla's.

vLLM publishes them when given ``kv_events_config`` (``KVEventsConfig(enable_kv_cache_events=True,
publisher="zmq", endpoint=..., topic=...)``); its ``KVEventBatch`` carries a trailing
``data_parallel_rank``, and its ``BlockStored``/``BlockRemoved`` a trailing ``medium``. SGLang publishes
its radix cache's events over ZMQ when started with ``kv_events_config`` (``--kv-events-config
'{"publisher": "zmq", "endpoint": ..., "topic": ...}'``). Each message is three frames, the topic, an 8-byte
big-endian sequence number and a msgpack ``KVEventBatch``. Their shapes, as ``python/sglang/srt/disaggregation/
kv_events.py`` declares them (read at sgl-project/sglang commit 006d053f; msgspec structs, ``array_like`` and
tagged with the class name)::

    KVEventBatch      [ts, [event, ...]]                       (a trailing attn_dp_rank in some versions)

vLLM 0.32 sends each event as a map instead (``{"type": "BlockStored", "block_hashes": ..., ...}``, with
more keys after ``medium``); both forms are read.
    BlockStored       ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id]
    BlockRemoved      ["BlockRemoved", block_hashes]
    AllBlocksCleared  ["AllBlocksCleared"]

Later versions may append fields (vLLM's same-named events append ``medium``, and so does SGLang's
hierarchical cache): the field after ``lora_id`` (after ``block_hashes`` in a removal) is the tier the blocks
are on, read by engines/shared/kv_tiers.py ("GPU" the device, vLLM's "CPU" and SGLang's "CPU_TIER1" host memory,
SGLang's "CPU_TIER2" its storage; a name Flotilla does not know is ``external``, never the device); anything
after it is ignored. ``translate_batch`` is pure over the decoded batch;
``ZmqSubscriber`` is the socket, in a thread of its own (pyzmq comes with SGLang).
"""

import logging
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from engines.shared.engine_block_names import EngineBlockNames
from engines.shared.kv_tiers import tier_of_name
from runtime.errors import EngineError
from runtime.kv.events import KvEvent
from runtime.ports import free_ports

log = logging.getLogger(__name__)

#: The fields of each event, in order, for events that come as maps (vLLM 0.32's: ``{"type": ..., ...}``).
_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _without_lora_name(keys: list[Any], lora_name: object) -> list[Any]:
    """A block's extra keys less its LoRA adapter's name. vLLM puts the adapter's name first in each block's keys
    (``to_event_extra_keys``, vllm/v1/core/kv_cache_utils.py); Flotilla names an adapter's blocks from the adapter's
    root hash instead (runtime/lora.py, ``EngineBlockNames.stored`` given ``lora_id``), as its routers name the
    adapter's requests, so the name must not be hashed in a second time."""
    if not isinstance(lora_name, str):
        return keys
    stripped: list[Any] = []
    for block in keys:
        if isinstance(block, list | tuple) and block and block[0] == lora_name:
            block = block[1:] or None
        stripped.append(block)
    return stripped


def translate_event(event: Any, names: EngineBlockNames) -> KvEvent | None:
    """Flotilla's event for one decoded event (a tagged list as SGLang sends it, or a map with its ``type`` as
    vLLM 0.32 sends it), or None for one that names nothing Flotilla can route on (unknown parent, another
    block size, an unknown tag)."""
    extra_keys = None
    if isinstance(event, dict):
        # vLLM's per-block extra keys: its images' (identifier, offset) pairs among them (image_blocks.py).
        if isinstance(keys := event.get("extra_keys"), list):
            extra_keys = _without_lora_name(keys, event.get("lora_name"))
        fields_of = _FIELDS.get(event.get("type"))  # type: ignore[arg-type]
        if fields_of is None:
            return None
        event = [event["type"], *(event.get(field) for field in fields_of)]
    if not isinstance(event, list | tuple) or not event:
        return None
    tag, fields = event[0], event[1:]
    if tag == "BlockStored" and len(fields) >= 5:
        block_hashes, parent, token_ids, block_size, lora_id = fields[:5]
        if block_size != names.block_size:
            return None
        medium = tier_of_name(fields[5]) if len(fields) > 5 else None
        return names.stored(block_hashes, parent, token_ids, lora_id=lora_id, medium=medium, extra_keys=extra_keys)
    if tag == "BlockRemoved" and len(fields) >= 1:
        medium = tier_of_name(fields[1]) if len(fields) > 1 else None
        return names.removed(fields[0], medium=medium)
    if tag == "AllBlocksCleared":
        return names.cleared()
    return None


def translate_batch(batch: Any, names: EngineBlockNames) -> list[KvEvent]:
    """Flotilla's events for one decoded ``KVEventBatch`` (``[ts, events, ...]``), in order."""
    if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list):
        return []
    return [translated for event in batch[1] if (translated := translate_event(event, names)) is not None]


def message_payload(frames: list[bytes]) -> bytes:
    """The payload (the msgpack batch, undecoded) of one ZMQ message (topic, sequence number, payload).
    Raises ValueError."""
    if len(frames) != 3:
        raise ValueError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    return frames[2]


def decode_payload(payload: bytes) -> Any:
    """The decoded batch of one message's payload. Raises ValueError."""
    try:
        return msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a msgpack KV event batch: {exc}") from None


def decode_message(frames: list[bytes]) -> Any:
    """The decoded batch of one ZMQ message (topic, sequence number, payload). Raises ValueError."""
    return decode_payload(message_payload(frames))


class ZmqSubscriber:
    """Reads one SGLang publisher's messages in a thread and hands each batch, as ``decode`` makes it of the
    message's frames (decoded by default; ``message_payload`` for the raw bytes), to ``on_batch`` (called in that
    thread). ``close()`` stops it within a poll interval."""

    POLL_MS = 200

    def __init__(
        self,
        endpoint: str,
        topic: str,
        on_batch: Callable[[Any], None],
        *,
        decode: Callable[[list[bytes]], Any] = decode_message,
    ) -> None:
        import zmq  # SGLang depends on pyzmq; Flotilla does not

        self._zmq = zmq
        self._socket: Any = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        # SGLang's publisher binds a wildcard ("tcp://*:PORT") and connects anything else; Flotilla gives it
        # the wildcard form and connects here.
        self._socket.connect(endpoint.replace("*", "127.0.0.1"))
        self._on_batch = on_batch
        self._decode = decode
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sglang-kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            if not self._socket.poll(self.POLL_MS):
                continue
            frames = self._socket.recv_multipart()
            try:
                self._on_batch(self._decode(frames))
            except ValueError as exc:
                log.warning("SGLang KV event message skipped: %s", exc)

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=2)
        self._socket.close(linger=0)


def free_tcp_ports(count: int) -> int:
    """The first of ``count`` consecutive free loopback ports, outside the kernel's ephemeral range (where the
    engine's own connections could take them before its publishers bind). Raises EngineError when none are found."""
    try:
        return free_ports(count)
    except OSError as exc:
        raise EngineError(f"no free ports for an engine's KV event publishers: {exc}") from exc
